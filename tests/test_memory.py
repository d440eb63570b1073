"""The storage census (:class:`ds_mp.engine.memory.HeldMemory`) against hand counts.

Every figure is a difference from the census at the start of the test (the test process holds
other tensors): known tensors give their storages' bytes once each (a view costs nothing more),
autograd's saved tensors are counted while a graph holds them and released with it, tensors in
Python containers (recorded gradients) are counted, static tensors (weights, ``.grad``) are not."""
from __future__ import annotations

import torch

from ds_mp.engine.memory import HeldMemory, SavedActivations, static_tensors
from ds_mp.schedules.timetable import modelled_peak
from ds_mp.schedules.simulate import Op

F32 = 4


def test_census_counts_storages_once() -> None:
    w = torch.nn.Parameter(torch.randn(6, 6))
    census = HeldMemory(lambda: [w, w.grad] if w.grad is not None else [w])
    with census:
        base = census.held()
        a = torch.zeros(1000)
        view = a[10:20]  # noqa: F841 - same storage as a: no more bytes
        b = torch.zeros(250, dtype=torch.float64)
        recorded = {"grads": [torch.ones(10)]}  # noqa: F841 - what a split backward keeps for W
        assert census.held() - base == 1000 * F32 + 250 * 8 + 10 * F32
        x = torch.randn(4, 6)
        y = (x @ w).sin()  # saves x (held anyway) and the product (for sin's backward); w is static
        loss = y.sum()
        known = 1000 * F32 + 250 * 8 + 10 * F32 + 3 * 24 * F32 + F32  # x, product, y; the scalar loss
        assert census.held() - base == known
        loss.backward()  # frees the product; creates w.grad (static)
        assert census.held() - base == known - 24 * F32
        del a, view, b, recorded, x, y, loss
        assert census.held() == base


def test_census_releases_a_graph_saving_its_own_output() -> None:
    """tanh saves its output: the pack hook must not hold it with its grad_fn (a cycle through C++
    that gc cannot collect would keep every graph alive)."""
    census = HeldMemory()
    with census:
        base = census.held()
        x = torch.randn(64, 64, requires_grad=True)
        y = x.tanh().exp()
        assert census.held() - base == 3 * 64 * 64 * F32  # x, tanh's output (saved by both), exp's output
        del y
        assert census.held() - base == 64 * 64 * F32


def test_census_samples_and_saved_activations_agree() -> None:
    """A linear + GELU: what autograd saves beyond the input (GELU's input z) is what
    :class:`SavedActivations` counts, and the census sees it alongside the output; the backward
    frees it.  (Saved-tensor hooks do not nest: each meter runs the graph on its own.)"""
    lin = torch.nn.Linear(32, 32)
    x = torch.randn(8, 32)
    with SavedActivations(lin.parameters()) as saved:
        torch.nn.functional.gelu(lin(x)).sum().backward()
    census = HeldMemory(lambda: static_tensors(lin))
    with census:
        base = census.sample()
        h = torch.nn.functional.gelu(lin(x))
        census.sample()
        h.sum().backward()
        census.sample()
    assert saved.peak == 2 * 8 * 32 * F32  # x and z
    assert [n - base for n in census.samples] == [0, 2 * 8 * 32 * F32, 8 * 32 * F32]  # z and h; then h


def test_modelled_peak() -> None:
    F, B, W = (lambda m: Op("F", m)), (lambda m: Op("B", m)), (lambda m: Op("W", m))
    assert modelled_peak([F(0), F(1), B(0), B(1)]) == 2
    assert modelled_peak([F(0), B(0), F(1), B(1), W(0), W(1)], 1.5) == 3.0
    assert modelled_peak([F(0), B(0), W(0), F(1), B(1), W(1)], 1.5) == 1.5
