"""The test grids' helper (``helpers.grid``): every pair of values by default, nothing lost."""

import itertools

import pytest
from helpers import covering_rows, grid


def _pair_set(rows):
    return {
        (a, row[a], b, row[b])
        for row in rows
        for a, b in itertools.combinations(range(len(row)), 2)
    }


@pytest.mark.parametrize("sizes", [(2, 2), (2, 4, 4, 4, 2), (3, 3, 3), (5, 1, 4), (2,) * 9])
def test_covering_rows_cover_every_pair_of_values(sizes):
    product = list(itertools.product(*(range(n) for n in sizes)))
    rows = covering_rows(sizes)
    assert set(rows) <= set(product) and len(set(rows)) == len(rows)
    assert _pair_set(rows) == _pair_set(product)


def test_covering_rows_are_few():
    assert len(covering_rows((2,) * 9)) <= 10  # of 512; 6 is the least possible
    assert len(covering_rows((2, 4, 4, 4, 2))) == 16  # of 256; 16 is the least possible


def test_grid_splits_the_product_into_the_tiers_with_corners_and_where():
    names, params = grid(
        a=[0, 1, 2],
        b=["x", "y"],
        c=[True, False],
        corners=[dict(a=2, b="y", c=False)],
        where=lambda a, b, c: not (a == 0 and c is False),
        ids={"c": lambda c: "on" if c else "off"},
    )
    assert names == "a,b,c"
    product = [(a, b, c) for a, b, c in itertools.product([0, 1, 2], "xy", [True, False]) if a or c]
    assert [p.values for p in params] == product  # the whole product, in order, once
    default = [p.values for p in params if not p.marks]
    assert all([m.name for m in p.marks] == ["exhaustive"] for p in params if p.marks)
    assert (2, "y", False) in default
    assert _pair_set(default) == _pair_set(product)
    assert params[0].id == "0-x-on"


def test_grid_spreads_a_pytest_param_axis_over_its_argument_names():
    shapes = [pytest.param((3,), 4, id="1d"), pytest.param((5, 3), 1, id="2d")]
    names, params = grid(**{"x_shape, out": shapes}, bias=[True, False], corners=[])
    assert names == "x_shape,out,bias"
    assert [(p.values, p.id) for p in params] == [
        (((3,), 4, True), "1d-True"),
        (((3,), 4, False), "1d-False"),
        (((5, 3), 1, True), "2d-True"),
        (((5, 3), 1, False), "2d-False"),
    ]
    _, params = grid(
        **{"x_shape,out": shapes}, bias=[True], corners=[{"x_shape,out": "2d", "bias": True}]
    )
    assert not any(p.marks for p in params)


def test_grid_refuses_a_corner_outside_its_axes():
    with pytest.raises(ValueError, match="`corners`"):
        grid(a=[1, 2], corners=[dict(a=3)])
    with pytest.raises(ValueError, match="`corners`"):
        grid(a=[1, 2], b=[1], corners=[dict(a=1)])
