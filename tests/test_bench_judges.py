"""bench judges' pixel facts on constructed images (the bench itself reads a fitted chain)."""

from __future__ import annotations

import torch

from bench.bench_judges import corners, right_heavy


def test_right_heavy_reads_which_half_holds_the_ink():
    img = torch.zeros(3, 28, 28, 3, dtype=torch.uint8)
    img[0, :, 20:] = 200  # ink on the right
    img[1, :, :5] = 200  # ink on the left
    img[2, :, 14:] = 100  # the middle column: odd widths split evenly, even ones exactly
    img[2, :, :14] = 100
    assert right_heavy(img).tolist() == [True, False, False]
    assert right_heavy(torch.flip(img, dims=[2])).tolist() == [False, True, False]


def test_corners_average_the_four_patches():
    img = torch.zeros(2, 28, 28, 3, dtype=torch.uint8)
    img[0, :4, :4] = 40  # one corner of four
    img[1, 10:18, 10:18] = 255  # ink in the middle only
    assert corners(img).tolist() == [10.0, 0.0]
