"""Constraints at run time: a hole's constraint AST becomes token masks plus stop rules.

`constraint_for_hole` picks the conjuncts of a query's `where` that concern one hole, `check_constraint`
does the static checks before any model call, and `compile_hole_constraint` turns a hole's constraint into
a `HoleConstraint` whose `start()` gives the per-generation `HoleState` the engine drives (its contract,
what the backend calls per token, is at the top of `hole.py`).

The files, in the order a constraint goes through them:

  selection.py  which conjuncts of a `where` concern one hole
  checks.py     static checks before any model call; the argument checks the compiler repeats
  compiler.py   constraint AST -> HoleConstraint: a tree of mask nodes plus stop rules
  nodes.py      the mask nodes' contract (node -> per-generation state), free text, and / or / not
  masks.py      lmq's own masks: choice, INT, STARTS_WITH, (not) contains, length in characters
  llg.py        REGEX, JSON, GRAMMAR on llguidance
  stops.py      stop rules (STOPS_AT, STOPS_BEFORE) and `Stop`
  hole.py       HoleConstraint, HoleState

Values are bytes inside. Masks are numpy operations over the vocabulary or lookups proportional to the
option / string lengths, using the tables of `VocabIndex`; regular expressions, JSON schemas and grammars
run on llguidance. Special tokens and EOS are never in a mask: ending is what `can_end()` says.

Mask kinds, per constraint:
  X in options       exact: value + token must be a prefix of an option (a byte trie over the options)
  INT(X)             ^ ?-?[0-9]+$ (one optional leading space); a 4-state DFA, one mask per state
  STARTS_WITH(X, s)  value + token is a prefix of s or starts with s
  s in X             allowed: all; can_end: s occurs in the value
  not s in X         allowed: tokens t with s not in value + t; can_end: True
  len(X) < n         characters (non-continuation UTF-8 bytes, additive per token)
  not len(X) < n     allowed: all; can_end: len(value) >= n
  REGEX/JSON/GRAMMAR llguidance LLMatcher
  not A              (A a choice, INT or STARTS_WITH): allowed: all non-special; can_end: not A.can_end()
  and / or           intersection + all / union + any
Stop rules (only as top-level conjuncts): STOPS_AT, STOPS_BEFORE, len(TOKENS(X)) < n.
"""
from .checks import NOT_LITERAL, check_constraint
from .compiler import compile_hole_constraint
from .hole import HoleConstraint, HoleState
from .selection import constraint_for_hole, hole_vars
from .stops import Stop

__all__ = [
    "NOT_LITERAL", "Stop", "HoleConstraint", "HoleState", "constraint_for_hole", "check_constraint",
    "compile_hole_constraint", "hole_vars",
]
