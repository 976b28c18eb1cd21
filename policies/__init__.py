"""Remediation policies shipped with the supervisor.

`policies.default:DefaultPolicy` is the policy used unless `SUPERVISOR_POLICY` names another;
`policies.examples` holds small variations of it to copy from. Policies are pure Python: they
import only `supervisor.domain`, `supervisor.policy` and the standard library.
"""

from policies.default import DefaultPolicy

__all__ = ["DefaultPolicy"]
