"""The supervisor's exceptions, under one root. Each is defined beside the code that
raises it (its module in brackets); the API maps the ones a request can meet to a status.

SupervisorError
├── UnknownTarget        a fault or action names a node or job not known: 404
├── RequestRefused       well formed, but cannot be taken as it stands: 409/422
│   └── JoinConflict     a launching host's join contradicts the job: 409 (local.hosts)
├── FaultNotSupported    the fault cannot be acted out with this backend: 422
├── ConfigError          settings that cannot be used (config)
├── PolicyLoadError      the configured policy cannot be loaded (controller.loader)
├── InvalidCursor        a page cursor this API did not hand out: 422 (store.queries)
├── ActionStatusMove     an action status move the transition table refuses (store.actions)
├── InvalidParams        an action's params do not fit its type: 422 (action_params)
├── RankClaimed          a heartbeat claims a rank another live node runs (sensor.claims)
├── StaleWorldReport     a report with live workers of an older world: 409 (sensor.worlds)
├── AgentTimeError       an agent's time outside the rule: 422 (agent_time)
├── ReviewUnavailable    a token could not be reviewed now (identity.authenticator)
├── ActionError          a backend could not carry out an action (actuator.backend)
├── Fenced               this replica lost leadership and may not act (actuator.backend)
├── ClusterError         the local cluster cannot do what was asked (local.cluster)
│   ├── InProcessFailed
│   └── NothingToSave  no registered worker to ask for an emergency checkpoint
├── RunFolderError       a folder that cannot be a run's: not ours, or in use (local.run_folder)
├── FlagRefused          a torchrun flag `supervisor run` cannot take here (torchrun_flags)
├── CalculatorLogError   a bad line of a goodput calculator log (goodput.calculator_log)
├── CliError             an operator command's failure, with its exit code (ops.errors)
├── JsonPathError        a -o jsonpath= template that cannot be read (ops.jsonpath)
├── KubeError            the Kubernetes side; its tree is drawn in kube.errors
├── ScenarioError        a simulation scenario that cannot be run (simulate.scenario)
├── TraceError           a fault trace that cannot be read (simulate.fault_sources)
└── SimulationStalled    the simulated system waits forever (simulate.clock)
"""

from __future__ import annotations


class SupervisorError(Exception):
    """Root of the supervisor's own errors."""


class UnknownTarget(SupervisorError, LookupError):
    """A fault or action names a node or job the supervisor does not know."""


class FaultNotSupported(SupervisorError, ValueError):
    """The fault cannot be acted out with this backend."""


class RequestRefused(SupervisorError, ValueError):
    """An operator's request that is well formed but cannot be taken as it stands (its
    message starts with the field it is about)."""
