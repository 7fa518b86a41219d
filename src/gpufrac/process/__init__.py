"""What every long-running component process shares: structured log lines, health/metrics probes, and
the controller runner (informers, leader lease, probes, shutdown) the scheduler and the operator run on.

Below the components (scheduler, admission, node agent, operator) so none of them imports another.
"""
