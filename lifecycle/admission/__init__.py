"""Admission: pure checks from a spec and a platform to a plan, or to every refusal.

One module per check; ``pipeline`` runs them all and files each refusal under
the ``admit`` guard that reads it back.
"""

from lifecycle.admission.backends import backend_requests
from lifecycle.admission.budget import BudgetDecision, SharedBudget, plan_onload, stage_fits
from lifecycle.admission.pipeline import (
    Admission,
    ComponentAdmission,
    admit_pipeline,
    component_loaders,
)

__all__ = [
    "Admission",
    "BudgetDecision",
    "ComponentAdmission",
    "SharedBudget",
    "admit_pipeline",
    "backend_requests",
    "component_loaders",
    "plan_onload",
    "stage_fits",
]
