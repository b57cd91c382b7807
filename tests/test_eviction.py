"""The selection rule of :mod:`confkv.eviction` on hand-made slots with answers worked out by hand.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md): every expected
value below is spelled out, not computed with the code under test.
"""

import torch

from confkv.eviction import dropped_slots, protected_mask, select_kept


def test_protected_mask_marks_the_last_protect_positions_and_the_sinks():
    positions = torch.arange(10).view(1, 1, 10)
    valid = torch.ones(1, 10, dtype=torch.bool)
    mask = protected_mask(positions, valid, torch.tensor([9]), protect=3, sinks=2)
    # recent: 7, 8, 9 (the last 3 positions, 9 included); sinks: 0, 1
    assert mask[0, 0].tolist() == [True, True, False, False, False, False, False, True, True, True]


def test_protected_mask_is_relative_to_each_sequences_current_position():
    positions = torch.arange(6).expand(2, 1, 6)
    valid = torch.ones(2, 6, dtype=torch.bool)
    mask = protected_mask(positions, valid, torch.tensor([5, 3]), protect=2, sinks=0)
    assert mask[0, 0].tolist() == [False, False, False, False, True, True]
    # positions 4 and 5 lie after sequence 1's current token 3: they count as recent too
    assert mask[1, 0].tolist() == [False, False, True, True, True, True]


def test_protected_mask_zero_protect_and_zero_sinks_protect_nothing():
    positions = torch.arange(5).view(1, 1, 5)
    valid = torch.ones(1, 5, dtype=torch.bool)
    assert not protected_mask(positions, valid, torch.tensor([4]), protect=0, sinks=0).any()


def test_protected_mask_never_protects_invalid_slots():
    positions = torch.arange(5).view(1, 1, 5)
    valid = torch.tensor([[False, True, True, True, False]])
    mask = protected_mask(positions, valid, torch.tensor([4]), protect=2, sinks=1)
    assert mask[0, 0].tolist() == [False, False, False, True, False]


def test_select_kept_keeps_the_best_scores_in_slot_order():
    scores = torch.tensor([[[0.5, 0.1, 0.9, 0.3, 0.7]]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    protected = torch.zeros(1, 1, 5, dtype=torch.bool)
    index, kept_valid = select_kept(scores, valid, protected, torch.tensor([3]))
    assert index[0, 0].tolist() == [0, 2, 4]  # 0.5, 0.9, 0.7, in slot order
    assert kept_valid.tolist() == [[True, True, True]]


def test_select_kept_puts_protected_slots_before_higher_scores():
    scores = torch.tensor([[[0.5, 0.1, 0.9, 0.3, 0.7]]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    protected = torch.tensor([[[False, True, False, True, False]]])
    index, _ = select_kept(scores, valid, protected, torch.tensor([3]))
    assert index[0, 0].tolist() == [1, 2, 3]  # both protected slots, then the best score 0.9


def test_select_kept_never_keeps_invalid_slots_and_clips_to_the_valid_count():
    scores = torch.tensor([[[9.0, 1.0, 8.0, 2.0]]])
    valid = torch.tensor([[False, True, False, True]])
    protected = torch.zeros(1, 1, 4, dtype=torch.bool)
    index, kept_valid = select_kept(scores, valid, protected, torch.tensor([3]))
    assert kept_valid.tolist() == [[True, True]]  # only two valid slots
    assert index[0, 0].tolist() == [1, 3]


def test_select_kept_per_sequence_counts_and_per_head_choices():
    scores = torch.tensor([
        [[1.0, 4.0, 3.0, 2.0], [4.0, 1.0, 2.0, 3.0]],   # sequence 0, heads 0 and 1
        [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]],   # sequence 1
    ])
    valid = torch.ones(2, 4, dtype=torch.bool)
    protected = torch.zeros(2, 2, 4, dtype=torch.bool)
    index, kept_valid = select_kept(scores, valid, protected, torch.tensor([2, 1]))
    assert kept_valid.tolist() == [[True, True], [True, False]]
    assert index[0, 0].tolist() == [1, 2]
    assert index[0, 1].tolist() == [0, 3]
    assert index[1, 0, :1].tolist() == [3]
    assert index[1, 1, :1].tolist() == [0]
    assert ((index >= 0) & (index < 4)).all()  # the unused entries still point at real slots


def test_select_kept_of_nothing():
    scores = torch.zeros(1, 1, 0)
    index, kept_valid = select_kept(scores, torch.zeros(1, 0, dtype=torch.bool), torch.zeros(1, 1, 0, dtype=torch.bool),
                                    torch.tensor([4]))
    assert index.shape == (1, 1, 0) and kept_valid.shape == (1, 0)


def test_select_kept_clips_each_sequence_to_its_own_valid_count():
    scores = torch.tensor([[[5.0, 1.0, 2.0, 3.0]], [[1.0, 2.0, 3.0, 4.0]]])
    valid = torch.tensor([[False, True, False, False], [True, True, True, True]])
    protected = torch.zeros(2, 1, 4, dtype=torch.bool)
    index, kept_valid = select_kept(scores, valid, protected, torch.tensor([3, 3]))
    assert kept_valid.tolist() == [[True, False, False], [True, True, True]]  # sequence 0 has one valid slot
    assert index[0, 0, 0].item() == 1 and index[1, 0].tolist() == [1, 2, 3]


def test_select_kept_of_an_empty_batch():
    index, kept_valid = select_kept(torch.zeros(0, 2, 3), torch.zeros(0, 3, dtype=torch.bool),
                                    torch.zeros(0, 2, 3, dtype=torch.bool), torch.zeros(0, dtype=torch.int64))
    assert index.shape == (0, 2, 0) and kept_valid.shape == (0, 0)


def test_select_kept_shorter_sequences_get_their_best_slots_not_any_of_the_widest():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 1, 1000, generator=gen)
    valid = torch.ones(2, 1000, dtype=torch.bool)
    protected = torch.zeros(2, 1, 1000, dtype=torch.bool)
    index, kept_valid = select_kept(scores, valid, protected, torch.tensor([600, 5]))
    best5 = sorted(sorted(range(1000), key=lambda j: -scores[1, 0, j].item())[:5])
    assert kept_valid[1].sum().item() == 5 and index[1, 0, :5].tolist() == best5
    best600 = sorted(sorted(range(1000), key=lambda j: -scores[0, 0, j].item())[:600])
    assert index[0, 0].tolist() == best600


def test_dropped_slots_lists_each_heads_unkept_valid_slots_in_slot_order():
    # 18 slots (long enough for an unstable sort to reorder ties); per head a different kept set of equal size
    valid = torch.ones(2, 18, dtype=torch.bool)
    valid[1, :2] = False  # sequence 1: two padding slots, 16 valid
    kept_index = torch.tensor([[[0, 5, 17], [2, 3, 4]], [[6, 9, 12], [7, 8, 12]]])
    kept_valid = torch.tensor([[True, True, True], [True, True, False]])  # slot 12 of sequence 1 is not kept
    index, dropped_valid = dropped_slots(kept_index, kept_valid, valid)
    expected = [[[s for s in range(18) if s not in (0, 5, 17)], [s for s in range(18) if s not in (2, 3, 4)]],
                [[s for s in range(2, 18) if s not in (6, 9)], [s for s in range(2, 18) if s not in (7, 8)]]]
    assert [len(e) for e in expected[0] + expected[1]] == [15, 15, 14, 14]
    assert index.shape == (2, 2, 15) and index.dtype == torch.int64
    assert index[0].tolist() == expected[0]
    assert index[1, :, :14].tolist() == expected[1]  # the 15th entry of sequence 1 is filler
    assert dropped_valid.tolist() == [[True] * 15, [True] * 14 + [False]]


def test_dropped_slots_with_one_kv_head():
    index, dropped_valid = dropped_slots(torch.tensor([[[1, 2]]]), torch.tensor([[True, True]]),
                                         torch.ones(1, 4, dtype=torch.bool))
    assert index.tolist() == [[[0, 3]]] and dropped_valid.tolist() == [[True, True]]


def test_dropped_slots_of_an_empty_batch():
    index, dropped_valid = dropped_slots(torch.zeros(0, 2, 3, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.bool),
                                         torch.zeros(0, 5, dtype=torch.bool))
    assert index.shape == (0, 2, 0) and dropped_valid.shape == (0, 0)
