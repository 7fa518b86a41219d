"""What every long-running component process shares: structured log lines and health/metrics probes.

Below the components (scheduler, admission, node agent) so none of them imports another.
"""
