"""Hamiltonian-descent view of the AdaDiag optimizers: ODEs, Hamiltonians, integrators, checks.

Each optimizer's continuous-time limit (learning rate -> 0 with ``1 - beta_1 = a eta``,
``1 - beta_2 = b eta``) is a :class:`System`; :class:`SystemTerm` puts it on a
:class:`Problem`; :func:`integrate` solves it with a :class:`Solver` and a step-size
controller; :func:`check` judges the paper's claim ``dH/dt <= 0`` on the
trajectory.  See ``docs/ode.md`` for the equations and ``docs/errata.md`` for
the claims that fail.
"""

from .checks import CheckResult, Trajectory, check, well_posedness
from .claims import (
    CLAIMS,
    COUNTEREXAMPLES,
    Claim,
    ClaimEvaluation,
    Counterexample,
    counterexample,
    directional_derivative,
    evaluate_at,
    quadratic_problem,
    random_state,
    sufficient_condition,
)
from .controllers import ConstantStepSize, PIController
from .discrete import DiscreteLimit, discrete_limit, flow_of_config
from .events import Event, gradient_tolerance, loss_threshold
from .integrate import BasisSchedule, SaveAt, Solution, integrate
from .problems import (
    PROBLEMS,
    Problem,
    custom_problem,
    factorization_problem,
    least_squares_problem,
    make_problem,
    rosenbrock_problem,
)
from .reference import OrderResult, observed_order, reference_solution
from .solvers import SOLVERS, Dopri5, Euler, ExplicitRK, RK4Solver, SemiImplicitEuler, Solver, make_solver, rk_step
from .systems import (
    SYSTEMS,
    AdafactorODEState,
    AdamODEState,
    Basis,
    HfacODEState,
    MomentumODEState,
    System,
    compute_basis,
    hamiltonian,
    hamiltonian_rate,
    initial_state,
    make_system,
    no_system_reason,
    vector_field,
)
from .tableaus import DOPRI5, EULER, RK4, TABLEAUS, ButcherTableau
from .terms import BiasCorrectedTerm, ODETerm, SystemTerm, bias_corrected_rate, bias_corrected_term

__all__ = [
    "CLAIMS",
    "COUNTEREXAMPLES",
    "DOPRI5",
    "EULER",
    "PROBLEMS",
    "RK4",
    "SOLVERS",
    "SYSTEMS",
    "TABLEAUS",
    "AdafactorODEState",
    "AdamODEState",
    "Basis",
    "BasisSchedule",
    "BiasCorrectedTerm",
    "ButcherTableau",
    "CheckResult",
    "Claim",
    "ClaimEvaluation",
    "ConstantStepSize",
    "Counterexample",
    "DiscreteLimit",
    "Dopri5",
    "Euler",
    "Event",
    "ExplicitRK",
    "HfacODEState",
    "MomentumODEState",
    "ODETerm",
    "OrderResult",
    "PIController",
    "Problem",
    "RK4Solver",
    "SaveAt",
    "SemiImplicitEuler",
    "Solution",
    "Solver",
    "System",
    "SystemTerm",
    "Trajectory",
    "bias_corrected_rate",
    "bias_corrected_term",
    "check",
    "compute_basis",
    "counterexample",
    "custom_problem",
    "directional_derivative",
    "discrete_limit",
    "evaluate_at",
    "factorization_problem",
    "flow_of_config",
    "gradient_tolerance",
    "hamiltonian",
    "hamiltonian_rate",
    "initial_state",
    "integrate",
    "least_squares_problem",
    "loss_threshold",
    "make_problem",
    "make_solver",
    "make_system",
    "no_system_reason",
    "observed_order",
    "quadratic_problem",
    "random_state",
    "reference_solution",
    "rk_step",
    "rosenbrock_problem",
    "sufficient_condition",
    "vector_field",
    "well_posedness",
]
