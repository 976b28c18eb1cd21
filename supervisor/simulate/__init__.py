"""What if: the supervisor's own sensor, controller, policy and actuator, run on a
virtual clock against a simulated cluster and job, on faults from a trace or a failure
mix (`supervisor simulate`)."""
