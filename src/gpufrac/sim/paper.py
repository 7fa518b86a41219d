"""The paper's published means, to print next to ours (one table for the CLI and the benchmarks).

Mean GPU allocation ratios (%) of the paper's simulator, hkust-adsl/kubernetes-scheduler-simulator
experiments/analysis/expected_results, as listed in shared/data/openb/README.md (Weng et al., ATC'23).
"""

from __future__ import annotations

# trace -> policy -> (at 100% arrival, at 130% arrival)
PUBLISHED: dict[str, dict[str, tuple[float, float]]] = {
    "default": {"BestFit": (92.86, 93.08), "FGD": (95.23, 95.39)},
    "gpushare60": {"BestFit": (89.06, 89.36), "FGD": (91.25, 91.40)},
    "gpushare100": {"BestFit": (84.62, 85.01), "FGD": (86.64, 86.90)},
    "multigpu20": {"BestFit": (93.73, 93.93), "FGD": (95.53, 95.65)},
    "multigpu30": {"BestFit": (94.57, 94.72), "FGD": (96.36, 96.46)},
    "gpuspec10": {"BestFit": (93.10, 93.30), "FGD": (94.66, 94.95)},
    "gpuspec20": {"BestFit": (88.46, 93.30), "FGD": (94.66, 94.84)},
    "cpu050": {"BestFit": (93.56, 93.79), "FGD": (95.00, 95.21)},
    "cpu100": {"BestFit": (93.26, 93.44), "FGD": (95.21, 95.35)},
}

# Our policy that re-implements each published one.
COUNTERPART = {"binpack": "BestFit", "fgd": "FGD"}


def published(trace: str, policy: str) -> tuple[float, float] | None:
    """The paper's (at 100%, at 130%) for our ``policy`` on ``trace``, if it published one."""
    name = COUNTERPART.get(policy)
    return PUBLISHED.get(trace, {}).get(name) if name else None
