"""``kubectl gpufrac``: the cluster's GPU fractions seen from kubectl (an executable named kubectl-gpufrac).

kubectl runs any ``kubectl-<name>`` on PATH as ``kubectl <name>``; the wheel installs ``kubectl-gpufrac``
as a console script. Above the components like ``local``: it reads Nodes, Pods and Events through the API
server and interprets them with the scheduler's own readers (``gpufrac.scheduler.objects``) and the
contract's parser, so what it shows is what the scheduler counts, never a second parse of the annotations.
"""
