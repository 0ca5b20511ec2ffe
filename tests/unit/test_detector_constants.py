"""Thresholds live in the detectors' frozen Params: a module-level number in argus/detectors is one of the kinds
below, each named here with its reason (docs/internals/detectors.md, "Where the numbers live")."""

from __future__ import annotations

import ast
from pathlib import Path

import argus.detectors

MATH = "a mathematical constant or bound"
UNIT = "a unit or the integer-nanosecond resolution of times"
CALIBRATION = "the null law of a statistic, calibrated by simulation (its threshold is a Params field)"
NUMERICS = "the accuracy of a discretization or sample, not a decision"
SPEED = "a block, tile or fast-path size: results are the same at any value"
PLACEHOLDER = "an empty array or a record whose fields are filled in later"
INDEX = "a position in a tuple"
LAYOUT = "the bit layout of a packed integer key"

#: (module, name) -> why the number is no threshold.
ALLOWED = {
    ("cdf_grid", "_Z_HIGH"): MATH, ("cdf_grid", "_Z_LOW"): MATH, ("cdf_grid", "_CELLS_PER_Z"): NUMERICS,
    ("call_modes", "_BIN_BITS"): LAYOUT,
    ("cdf_grid", "_TILE"): SPEED, ("cdf_grid", "MEDIAN_SAMPLE"): NUMERICS, ("cdf_grid", "_NONE"): PLACEHOLDER,
    ("hangs", "_NS"): UNIT,
    ("kde_clusters", "_MAX_DURATION"): MATH, ("kde_clusters", "_SQRT_2PI"): MATH,
    ("kde_valleys", "KERNEL_SUPPORT"): NUMERICS, ("kde_valleys", "_POINTS_PER_BANDWIDTH"): NUMERICS,
    ("kde_valleys", "_KERNEL_ROUGHNESS"): MATH, ("kde_valleys", "_FIB"): MATH,
    ("kernel_rows", "_FEW_CLUSTERS"): SPEED,
    ("l1_iteration", "_MS"): UNIT, ("l1_iteration", "_Z_A"): CALIBRATION, ("l1_iteration", "_Z_B"): CALIBRATION,
    ("l2_compare", "_RESOLUTION_NS"): UNIT,
    ("l2_groups", "MAD_SCALE"): MATH, ("l2_groups", "_SHORT_ROW"): SPEED,
    ("l2_history", "_INT32_MAX"): MATH, ("l2_history", "_STAGED"): SPEED,
    ("l2_history", "_SORT_BLOCK_VALUES"): SPEED,
    ("l2_phases", "_MS"): UNIT,
    ("l3_ranks", "_TRIM_CALLS"): NUMERICS,
    ("links", "_EVIDENCE_BASE"): PLACEHOLDER, ("links", "_BELOW_CUT"): NUMERICS,
    ("mixture", "Z99"): MATH, ("mixture", "MIN_SIGMA"): NUMERICS, ("mixture", "TAIL_SIGMAS"): NUMERICS,
    ("mixture", "GRID_POINTS"): NUMERICS, ("mixture", "_PAIRWISE_BLOCK_ELEMENTS"): SPEED,
    ("phase_layout", "_EXACT_NS"): MATH, ("phase_layout", "_MAX_PAIRS_PER_PHASE"): NUMERICS,
    ("phase_layout", "_NONE"): PLACEHOLDER, ("phase_layout", "_FOLD_BLOCK"): SPEED, ("phase_layout", "_SECOND"): INDEX,
}


def _numbers_at_module_level() -> set[tuple[str, str]]:
    """(module, name) of every module-level assignment in argus/detectors whose value holds a number literal
    (``a, b = x, y`` judged element by element)."""
    found = set()
    for path in sorted(Path(argus.detectors.__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
                continue
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                pairs = [(target, node.value)]
                if (isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                        and len(target.elts) == len(node.value.elts)):
                    pairs = list(zip(target.elts, node.value.elts, strict=True))
                for names, value in pairs:
                    if any(isinstance(n, ast.Constant) and type(n.value) in (int, float) for n in ast.walk(value)):
                        found |= {(path.stem, n.id) for n in ast.walk(names) if isinstance(n, ast.Name)}
    return found


def test_module_level_numbers_in_detectors_are_no_thresholds() -> None:
    unlisted = _numbers_at_module_level() - ALLOWED.keys()
    assert not unlisted, (f"module-level numbers in argus/detectors: {sorted(unlisted)}; a threshold belongs in its "
                          "detector's frozen Params (a field with a #: comment, validated), anything else in ALLOWED "
                          "with its reason")


def test_the_list_names_only_numbers_that_exist() -> None:
    assert not ALLOWED.keys() - _numbers_at_module_level()
