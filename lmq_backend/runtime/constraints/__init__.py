"""Constraints at run time (a package; its files are split by role in the commits that follow this move)."""
from .masks import (
    NOT_LITERAL, HoleConstraint, HoleState, Stop, check_constraint, compile_hole_constraint, constraint_for_hole,
    hole_vars,
)

__all__ = [
    "NOT_LITERAL", "Stop", "HoleConstraint", "HoleState", "constraint_for_hole", "check_constraint",
    "compile_hole_constraint", "hole_vars",
]
