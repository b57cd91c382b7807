"""The cold tier's bit ladder (confkv/tiers/ladder.py) on hand-built pages: which pages step down, when a page
is dropped, and that the bytes it reports are the bytes it holds."""

from __future__ import annotations

import math

import pytest
import torch

from confkv.tiers import lowbit
from confkv.tiers.ladder import LadderTier
from confkv.tiers.storage import Storage

B, H, D, P = 2, 2, 16, 8


def _ladder(ladder=(8, 4, 2), pages=6, signal="heat", seed=0, unread_by="age", attention=None) -> LadderTier:
    tier = LadderTier(Storage(ladder=ladder, page_size=P, group_size=P, step_down_by=signal, unread_by=unread_by))
    gen = torch.Generator().manual_seed(seed)
    tokens = pages * P
    keys = torch.randn(B, H, tokens, D, generator=gen)
    values = torch.randn(B, H, tokens, D, generator=gen)
    positions = torch.arange(tokens).expand(B, H, tokens).clone()
    tier.demote(keys, values, positions, torch.ones(B, tokens, dtype=torch.bool), attention)
    return tier


def _page_bytes(bits: int) -> int:
    return B * lowbit.page_bytes(H, D, P, bits, P, 4, digest=False)


def _set_heat(rung, heat_per_page: list[float]) -> None:
    """Give page j of every head ``heat_per_page[j]`` per read (one read since sealing)."""
    rung.reads = 1
    rung.pages["sealed_at"][:, :, :rung.num_pages] = 0
    rung.pages["heat"][:, :, :rung.num_pages] = torch.tensor(heat_per_page)


def _first_positions(rung) -> list[int]:
    """Each page's first position in sequence 0, head 0, in storage order."""
    return rung.pages["positions"][0, 0, :rung.num_pages, 0].tolist()


def test_bytes_are_the_bytes_held_on_every_rung():
    tier = _ladder()
    assert tier.kv_bytes() == 6 * _page_bytes(8)
    tier.fit(6 * _page_bytes(8) - 1, torch.float32)
    held = sum(t[:, :, :r.num_pages].nbytes for r in tier.rungs if r.open is not None
               for n, t in r.pages.items() if n not in ("positions", "valid", "heat", "sealed_at", "confidence", "attention"))
    held += sum(r.open["keys"].nbytes + r.open["values"].nbytes for r in tier.rungs if r.open is not None)
    assert tier.kv_bytes() == held == 5 * _page_bytes(8) + _page_bytes(4)


def test_the_coldest_pages_step_down_first_and_one_rung_at_a_time():
    tier = _ladder()
    _set_heat(tier.rungs[0], [5.0, 0.1, 3.0, 0.2, 4.0, 1.0])  # pages at positions 0, 8, 16, ...
    saving = _page_bytes(8) - _page_bytes(4)
    tier.fit(tier.kv_bytes() - 2 * saving, torch.float32)  # two pages must step down
    assert tier.rungs[0].num_pages == 4 and tier.rungs[1].num_pages == 2 and tier.rungs[2].num_pages == 0
    assert sorted(_first_positions(tier.rungs[1])) == [8, 24]  # heats 0.1 and 0.2
    assert sorted(_first_positions(tier.rungs[0])) == [0, 16, 32, 40]


@pytest.mark.parametrize("pages", [1, 3])
def test_one_move_steps_as_many_pages_as_the_excess_needs(pages, monkeypatch):
    """The fit moves ``ceil(excess / bytes one step frees)`` of a rung's coldest pages in one re-quantization (one
    ``put_pages`` on the rung below), not one page a move: an excess of ``pages`` steps' worth is one move."""
    tier = _ladder()
    _set_heat(tier.rungs[0], [5.0, 0.1, 3.0, 0.2, 4.0, 1.0])
    moves = []
    put = type(tier.rungs[1]).put_pages
    monkeypatch.setattr(tier.rungs[1], "put_pages", lambda taken, dtype: (moves.append(taken["keys"].shape[2]),
                                                                          put(tier.rungs[1], taken, dtype)))
    tier.fit(tier.kv_bytes() - pages * (_page_bytes(8) - _page_bytes(4)), torch.float32)
    assert moves == [pages]
    assert [r.num_pages for r in tier.rungs] == [6 - pages, pages, 0]


def test_nothing_is_dropped_while_a_page_can_still_step_down():
    tier = _ladder(pages=4)
    budget = 4 * _page_bytes(2) + 1  # everything fits at the bottom rung
    tier.fit(budget, torch.float32)
    assert [r.num_pages for r in tier.rungs] == [0, 0, 4]
    assert int(tier.token_count().sum()) == B * 4 * P  # every token kept


def test_at_the_bottom_the_coldest_pages_are_dropped_then_the_open_page():
    tier = _ladder(pages=4)
    tier.fit(4 * _page_bytes(2), torch.float32)
    _set_heat(tier.rungs[2], [0.0] * 4)
    bottom = tier.rungs[2]
    bottom.pages["heat"][:, :, :4] = torch.tensor([2.0, 0.5, 3.0, 1.0])
    tier.fit(2 * _page_bytes(2), torch.float32)
    assert sorted(_first_positions(bottom)) == [0, 16]  # the two hottest stay
    extra = torch.randn(B, H, 3, D)
    tier.demote(extra, extra, torch.full((B, H, 3), 99), torch.ones(B, 3, dtype=torch.bool))
    assert tier.top.open_length == 3
    tier.fit(0, torch.float32)
    assert tier.kv_bytes() == 0 and tier.top.open_length == 0 and bottom.num_pages == 0


@pytest.mark.parametrize("signal, expected", [("age", [0, 8]), ("confidence", [16, 24])])
def test_other_signals_order_the_steps(signal, expected):
    tier = _ladder(pages=4, signal=signal)
    tier.rungs[0].pages["confidence"][:, :, :4] = torch.tensor([0.1, 0.2, 0.9, 0.8])  # 1 - c: uncertain kept
    saving = _page_bytes(8) - _page_bytes(4)
    tier.fit(tier.kv_bytes() - 2 * saving, torch.float32)
    assert sorted(_first_positions(tier.rungs[1])) == expected


def test_a_page_keeps_its_tokens_and_positions_when_it_steps_down():
    tier = _ladder(ladder=(16, 8), pages=2)
    before = tier.rungs[0].pages["positions"][:, :, :2].clone()
    keys16 = tier.rungs[0].pages["keys"][:, :, :2].clone()
    tier.fit(tier.kv_bytes() - 1, torch.float32)
    lower = tier.rungs[1]
    assert lower.num_pages == 1
    moved = lower.pages["positions"][:, :, 0]
    assert any(torch.equal(moved, before[:, :, j]) for j in range(2))
    j = 0 if torch.equal(moved, before[:, :, 0]) else 1
    keys, _ = lower._dequantized({n: t.narrow(2, 0, 1) for n, t in lower.pages.items()}, torch.zeros(B, H, 1, dtype=torch.long))
    scale = (keys16[:, :, j].amax(-2) - keys16[:, :, j].amin(-2)) / 255  # 8-bit per-channel step over the page
    assert (keys[:, :, 0] - keys16[:, :, j]).abs().le(scale[:, :, None, :] / 2 + 1e-3).all()


@pytest.mark.parametrize("order, stepped_rung", [("error", 0), ("coldest", 1)])
def test_the_step_order_picks_the_rung(order, stepped_rung):
    """A warm 8-bit page and a colder 4-bit page: stepping 8 -> 4 adds far less error per byte than
    4 -> 2 (so "error" steps the warm page), while "coldest" steps the colder page."""
    tier = LadderTier(Storage(ladder=(8, 4, 2), page_size=P, group_size=P, step_order=order))
    keys = torch.randn(B, H, 2 * P, D)
    tier.demote(keys, keys, torch.arange(2 * P).expand(B, H, 2 * P).clone(), torch.ones(B, 2 * P, dtype=torch.bool))
    tier.rungs[1].put_pages(tier.rungs[0].take_pages(torch.zeros(B, H, 1, dtype=torch.long)), torch.float32)
    _set_heat(tier.rungs[0], [1.0])
    _set_heat(tier.rungs[1], [0.5])
    before = [r.num_pages for r in tier.rungs]
    assert before == [1, 1, 0]
    tier.fit(tier.kv_bytes() - 1, torch.float32)
    after = [r.num_pages for r in tier.rungs]
    assert after[stepped_rung] == 0 and after[stepped_rung + 1] == before[stepped_rung + 1] + 1


def _error_growth(upper: int, lower: int) -> float:
    """A uniform quantizer's mean squared error grows as ``4**-bits``; 16 bits (the model's dtype) adds none."""
    return 4.0 ** -lower - (0.0 if upper == 16 else 4.0 ** -upper)


def _break_even(top: int = 8) -> float:
    """The heat ratio at which a ``top``-bit page's step to 4 bits costs what a 4-bit page's step to 2 bits does."""
    return (_error_growth(4, 2) / (_page_bytes(4) - _page_bytes(2))) / (
        _error_growth(top, 4) / (_page_bytes(top) - _page_bytes(4)))


def _one_page_on_rungs_0_and_1(signal: str = "heat", top: int = 8) -> LadderTier:
    """A (top, 4, 2) ladder, error order, one page on the top rung (positions 8-15) and one on the 4-bit rung (0-7)."""
    tier = LadderTier(Storage(ladder=(top, 4, 2), page_size=P, group_size=P, step_order="error", step_down_by=signal))
    keys = torch.randn(B, H, 2 * P, D, generator=torch.Generator().manual_seed(6))
    tier.demote(keys, keys, torch.arange(2 * P).expand(B, H, 2 * P).clone(), torch.ones(B, 2 * P, dtype=torch.bool))
    tier.rungs[1].put_pages(tier.rungs[0].take_pages(torch.zeros(B, H, 1, dtype=torch.long)), torch.float32)
    return tier


@pytest.mark.parametrize("top", [8, 16])
@pytest.mark.parametrize("share, stepped_rung", [(0.97, 0), (1.03, 1)])
def test_the_error_order_weighs_each_step_s_added_error_per_byte_freed(top, share, stepped_rung):
    """``step_order="error"`` prices a step as the page's value times the growth of a uniform quantizer's squared
    error (:func:`_error_growth`) per byte it frees. A ``top``-bit page ``share * break_even`` times as hot as a
    4-bit page: stepping it to 4 bits costs that heat times ``growth(top, 4) / (bytes top -> 4 free)``, the 4-bit
    page's step to 2 bits ``growth(4, 2) / (bytes 4 -> 2 free)``: the break-even ratio is worked out from that rule,
    and a heat ratio 3% below it steps the top page, 3% above it the 4-bit one (an error growth of ``4**-lower``
    alone, or of ``4**-lower + 4**-upper``, puts the break-even 6% and 12% higher; a 16-bit page priced as if it
    had a 16-bit error of 1, or 4-bit pages as if exact, moves it as far)."""
    tier = _one_page_on_rungs_0_and_1(top=top)
    _set_heat(tier.rungs[0], [share * _break_even(top)])
    _set_heat(tier.rungs[1], [1.0])
    tier.fit(tier.kv_bytes() - 1, torch.float32)
    after = [r.num_pages for r in tier.rungs]
    assert after[stepped_rung] == 0 and after[stepped_rung + 1] == 1 + (stepped_rung == 0)


def test_a_rung_s_price_is_the_mean_over_heads_of_each_head_s_coldest_page():
    """Each head steps its own coldest page, so a rung's price is the mean over sequences and heads of each head's
    least page value, not the least over all heads (nor the least over heads, page by page). An 8-bit page at 0.5 x
    the break-even heat ratio in head 0 and 2.16 x in head 1 (mean 1.33 x) against a 4-bit page at 1 in both: the
    4-bit page steps down (priced by the least value over all heads, the 8-bit one would)."""
    tier = _one_page_on_rungs_0_and_1()
    _set_heat(tier.rungs[1], [1.0])
    _set_heat(tier.rungs[0], [0.0])
    tier.rungs[0].pages["heat"][:, 0, 0] = 0.5 * _break_even()
    tier.rungs[0].pages["heat"][:, 1, 0] = 2.16 * _break_even()
    tier.fit(tier.kv_bytes() - 1, torch.float32)
    assert [r.num_pages for r in tier.rungs] == [1, 0, 1]


@pytest.mark.parametrize("newest", [225, 255])
def test_by_age_a_page_is_worth_its_newest_position_plus_one(newest):
    """``step_down_by="age"``: a page's value is its newest position + 1 (so that position 0 is not free). The 4-bit
    page's newest position is 7 (value 8); the 8-bit page's is ``newest``: it steps down first when ``(newest + 1) /
    8`` is below the break-even ratio (225), else the 4-bit page does (255). Without the + 1, or with + 2, one of the
    two flips."""
    tier = _one_page_on_rungs_0_and_1("age")
    tier.rungs[0].pages["positions"][:, :, 0] = newest - P + 1 + torch.arange(P)
    tier.fit(tier.kv_bytes() - 1, torch.float32)
    eight_steps = (newest + 1) / 8 < _break_even()
    assert eight_steps == (newest == 225)
    assert [r.num_pages for r in tier.rungs] == ([0, 2, 0] if eight_steps else [1, 0, 1])


def test_pages_that_received_nothing_still_step_down_by_error_per_byte():
    """Every page read and given no attention: the prices are kept positive (a tiny constant is added to each value),
    so they still order by error added per byte freed and the 8-bit page steps down first."""
    tier = _one_page_on_rungs_0_and_1()
    _set_heat(tier.rungs[0], [0.0])
    _set_heat(tier.rungs[1], [0.0])
    tier.fit(tier.kv_bytes() - 1, torch.float32)
    assert [r.num_pages for r in tier.rungs] == [0, 2, 0]


def test_an_unread_page_counts_as_a_large_finite_value():
    """A page not read since it was sealed is worth +inf by heat; its price counts it as 1e30, so a mean over heads
    that holds one stays finite and ordered. The 8-bit page unread in every head (1e30) against the 4-bit page unread
    in one head of four (mean 2.5e29): 4**-4 - 4**-8 per byte freed is so much smaller than 4**-2 - 4**-4 that the
    8-bit page steps first (counted as the largest float instead, its mean would overflow to inf)."""
    tier = _one_page_on_rungs_0_and_1()
    _set_heat(tier.rungs[0], [1.0])
    _set_heat(tier.rungs[1], [5.0])
    tier.rungs[0].pages["sealed_at"][:, :, 0] = tier.rungs[0].reads  # unread in every head
    tier.rungs[1].pages["sealed_at"][0, 0, 0] = tier.rungs[1].reads  # unread in one head of one sequence
    tier.fit(tier.kv_bytes() - 1, torch.float32)
    assert [r.num_pages for r in tier.rungs] == [0, 2, 0]


def _open_only(count: int, **storage) -> LadderTier:
    """A ladder whose only tokens are ``count`` (< P) in the open page, positions 100, 101, ..."""
    tier = LadderTier(Storage(ladder=(8, 4, 2), page_size=P, group_size=P, **storage))
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(B, H, count, D, generator=gen)
    positions = (100 + torch.arange(count)).expand(B, H, count).clone()
    tier.demote(keys, keys.flip(-1), positions, torch.ones(B, count, dtype=torch.bool))
    assert tier.top.open_length == count and tier.top.num_pages == 0
    return tier


SLOT_BYTES = 2 * B * H * D * 4  # one open slot (keys and values, every sequence and head) in float32


@pytest.mark.parametrize("count", [P - 1, 2])
def test_an_open_page_over_its_budget_is_sealed_early_and_stepped_down_not_dropped(count):
    """Open tokens that cost more than a bottom-rung page are sealed and stepped down, not dropped. Two tokens cost
    as much as a 4-bit page and more than a 2-bit one: the bottom rung's page is the one they are weighed against."""
    assert count * SLOT_BYTES > _page_bytes(2)  # worth sealing: its tokens cost more than a bottom page
    assert count > 2 or count * SLOT_BYTES == _page_bytes(4)
    tier = _open_only(count)
    tier.fit(_page_bytes(2), torch.float32)
    bottom = tier.rungs[2]
    assert [r.num_pages for r in tier.rungs] == [0, 0, 1] and tier.top.open_length == 0
    assert tier.kv_bytes() == _page_bytes(2)
    valid = bottom.pages["valid"][:, :, 0]  # [B, H, P]: the page's empty slot stays invalid
    assert valid[..., :count].all() and not valid[..., count:].any()
    assert bottom.pages["positions"][:, :, 0, :count].eq(100 + torch.arange(count)).all()
    assert int(tier.token_count().sum()) == B * count


@pytest.mark.parametrize("seal_early", [True, False])
def test_a_cheap_open_page_loses_only_its_oldest_slots(seal_early):
    """One open token costs less than a bottom page (sealing would not save bytes): it is dropped, not sealed;
    with seal_early=False any open page is trimmed: only as many of its oldest slots go as the budget needs."""
    count = 1 if seal_early else P - 1
    tier = _open_only(count, seal_early=seal_early)
    if seal_early:
        assert count * SLOT_BYTES <= _page_bytes(2)
    tier.fit((count - 1) * SLOT_BYTES, torch.float32)
    assert [r.num_pages for r in tier.rungs] == [0, 0, 0] and tier.top.open_length == count - 1
    assert tier.top.open["positions"].eq(100 + torch.arange(1, count)).all()  # the oldest one went
    assert tier.kv_bytes() == (count - 1) * SLOT_BYTES


def test_an_open_page_that_costs_exactly_a_bottom_page_is_trimmed_not_sealed():
    """Sealing saves bytes only when the open tokens cost more than a bottom-rung page: at exactly its cost the
    sealed page would be dropped whole at the bottom, so the oldest slots go instead. Pages of 16 slots, 16
    channels, 2 bits at the bottom, float32: 2 open tokens cost what one bottom page does."""
    tier = LadderTier(Storage(ladder=(8, 2), page_size=16, group_size=16))
    slot = 2 * B * H * 16 * 4
    assert 2 * slot == B * lowbit.page_bytes(H, 16, 16, 2, 16, 4, digest=False)
    keys = torch.randn(B, H, 2, 16, generator=torch.Generator().manual_seed(4))
    tier.demote(keys, keys.flip(-1), (100 + torch.arange(2)).expand(B, H, 2).clone(), torch.ones(B, 2, dtype=torch.bool))
    tier.fit(slot, torch.float32)
    assert [r.num_pages for r in tier.rungs] == [0, 0] and tier.top.open_length == 1
    assert tier.top.open["positions"].eq(101).all() and tier.kv_bytes() == slot


def test_token_count_adds_every_rung_per_sequence():
    """[B] valid tokens over all rungs: sequence 1 has 8 empty slots (left padding), wherever its pages sit."""
    tier = LadderTier(Storage(ladder=(8, 4), page_size=P, group_size=P))
    gen = torch.Generator().manual_seed(3)
    tokens = 6 * P
    valid = torch.ones(B, tokens, dtype=torch.bool)
    valid[1, :P] = False
    tier.demote(torch.randn(B, H, tokens, D, generator=gen), torch.randn(B, H, tokens, D, generator=gen),
                torch.arange(tokens).expand(B, H, tokens).clone(), valid)
    tier.fit(tier.kv_bytes() - 2 * (_page_bytes(8) - _page_bytes(4)), torch.float32)
    assert [r.num_pages for r in tier.rungs] == [4, 2]  # tokens on both rungs
    assert tier.token_count().tolist() == [48, 40]


def test_a_clone_reads_and_observes_on_its_own_pages():
    """A clone carries no read of its original (a read is one step's bookkeeping): observing masses before its
    own read changes nothing and does not fail; after its own read it heats its own pages, not the original's."""
    tier = _ladder(ladder=(8, 4))
    tier.fit(tier.kv_bytes() - (_page_bytes(8) - _page_bytes(4)), torch.float32)
    query = torch.randn(B, H, 1, D)
    segments = tier.segments(query, torch.zeros(B, dtype=torch.int64))
    masses = [torch.full(s.keys.shape[:3], 0.5) for s in segments]
    twin = tier.clone()
    twin.observe_read(masses)
    assert all(float(r.pages["heat"][:, :, :r.num_pages].sum()) == 0.0 for r in twin.rungs)
    twin.segments(query, torch.zeros(B, dtype=torch.int64))
    twin.observe_read(masses)
    assert all(float(r.pages["heat"][:, :, :r.num_pages].sum()) > 0.0 for r in twin.rungs)
    assert all(float(r.pages["heat"][:, :, :r.num_pages].sum()) == 0.0 for r in tier.rungs)


def test_selecting_rows_keeps_those_rows_on_every_rung():
    """Beam search / batch selection: row 1 taken twice; every rung keeps exactly the chosen rows' pages."""
    tier = LadderTier(Storage(ladder=(8, 4), page_size=P, group_size=P))
    gen = torch.Generator().manual_seed(4)
    tokens = 6 * P
    positions = (torch.arange(tokens) + 1000 * torch.arange(B)[:, None])[:, None].expand(B, H, tokens).clone()
    tier.demote(torch.randn(B, H, tokens, D, generator=gen), torch.randn(B, H, tokens, D, generator=gen),
                positions, torch.ones(B, tokens, dtype=torch.bool))
    tier.fit(tier.kv_bytes() - 2 * (_page_bytes(8) - _page_bytes(4)), torch.float32)
    before = [r.pages["positions"][:, :, :r.num_pages].clone() for r in tier.rungs]
    tier.select_batch(torch.tensor([1, 1]))
    for rung, old in zip(tier.rungs, before):
        now = rung.pages["positions"][:, :, :rung.num_pages]
        assert torch.equal(now, old[[1, 1]]) and int(now.min()) >= 1000  # sequence 1's positions, twice
    assert tier.token_count().tolist() == [48, 48]


def test_bookkeeping_bytes_add_every_rung_s_positions_validity_and_page_metadata():
    tier = _ladder(ladder=(8, 4))
    tier.fit(tier.kv_bytes() - 2 * (_page_bytes(8) - _page_bytes(4)), torch.float32)
    assert tier.bookkeeping_bytes() == sum(r.bookkeeping_bytes() for r in tier.rungs)
    assert all(r.bookkeeping_bytes() > 0 for r in tier.rungs)
    # per sealed page of one head: P int64 positions + P bool valid + heat (float32) + sealed_at (int64)
    # + confidence (float32) + attention while hot (float32); the open page (empty after sealing) holds nothing
    rung0, rung1 = tier.rungs
    per_page = {n: t.element_size() * t[0, 0, 0].numel() for n, t in rung1.pages.items()
                if n in ("positions", "valid", "heat", "sealed_at", "confidence", "attention")}
    assert rung1.bookkeeping_bytes() == B * H * rung1.num_pages * sum(per_page.values()) \
        + rung1.open["positions"].nbytes + rung1.open["valid"].nbytes + rung1.open["attention"].nbytes


def _token_attention(per_page: list[float]) -> torch.Tensor:
    """[B, H, pages * P]: every token of page j received per_page[j] / P per query while hot."""
    return torch.tensor(per_page).repeat_interleave(P).div(P).expand(B, H, -1).clone()


@pytest.mark.parametrize("unread_by,stepped", [("attention", [8, 24]), ("age", [0, 8]), ("attention-drops", [0, 8])])
def test_unread_pages_step_down_by_the_attention_they_received_while_hot_or_by_age(unread_by, stepped):
    """No page has been read (heat unknown, all +inf): ``unread_by`` orders them; ``"attention-drops"`` steps them
    down by age."""
    tier = _ladder(unread_by=unread_by, attention=_token_attention([5.0, 0.1, 3.0, 0.2, 4.0, 1.0]))
    torch.testing.assert_close(tier.rungs[0].pages["attention"][:, :, :6],
                               torch.tensor([5.0, 0.1, 3.0, 0.2, 4.0, 1.0]).expand(B, H, 6))
    saving = _page_bytes(8) - _page_bytes(4)
    tier.fit(tier.kv_bytes() - 2 * saving, torch.float32)
    assert sorted(_first_positions(tier.rungs[1])) == stepped
    torch.testing.assert_close(tier.rungs[1].pages["attention"][0, 0, :2].sort().values,  # kept when stepping down
                               torch.tensor([0.1, 0.2] if unread_by == "attention" else [0.1, 5.0]))


def test_a_read_page_s_heat_outranks_the_attention_it_had_while_hot():
    """Attention while hot only orders pages among equals: a page read and found cold goes before an unread one,
    and read pages go by their heat whatever they received before."""
    tier = _ladder(unread_by="attention", attention=_token_attention([0.1, 9.0, 0.2, 8.0, 7.0, 6.0]))
    top = tier.rungs[0]
    top.reads = 1
    top.pages["sealed_at"][:, :, :6] = torch.tensor([0, 0, 0, 0, 1, 1])  # pages 4 and 5 not read yet
    top.pages["heat"][:, :, :6] = torch.tensor([3.0, 0.5, 2.0, 1.0, 0.0, 0.0])
    saving = _page_bytes(8) - _page_bytes(4)
    tier.fit(tier.kv_bytes() - 3 * saving, torch.float32)
    assert sorted(_first_positions(tier.rungs[1])) == [8, 16, 24]  # heats 0.5, 1.0, 2.0


def test_the_attention_of_a_page_counts_its_valid_tokens_only():
    """Row 1 has one padding slot (attention 100): left-aligned, it ends row 1's second page, uncounted."""
    tier = LadderTier(Storage(ladder=(8, 4), page_size=P, group_size=P, unread_by="attention"))
    keys = torch.randn(2, H, 2 * P, D)
    valid = torch.ones(2, 2 * P, dtype=torch.bool)
    valid[1, 1] = False
    attention = torch.ones(2, H, 2 * P)
    attention[1, :, 1] = 100.0
    tier.demote(keys, keys, torch.arange(2 * P).expand(2, H, -1).clone(), valid, attention)
    top = tier.rungs[0]
    assert top.num_pages == 2 and top.open_length == 0
    assert top.pages["attention"][:, :, :2].tolist() == [[[P, P]] * H, [[P, P - 1]] * H]


@pytest.mark.parametrize("unread_by,kept", [("attention", [0, 16, 32, 40]), ("age", [16, 24, 32, 40]),
                                            ("attention-drops", [0, 16, 32, 40])])
def test_unread_pages_at_the_bottom_are_dropped_by_the_attention_they_received_while_hot_or_by_age(unread_by, kept):
    tier = _ladder(ladder=(2,), unread_by=unread_by, attention=_token_attention([5.0, 0.1, 3.0, 0.2, 4.0, 1.0]))
    tier.fit(tier.kv_bytes() - 2 * _page_bytes(2), torch.float32)
    assert sorted(_first_positions(tier.rungs[0])) == kept


@pytest.mark.parametrize("slack", [0.0, 0.2])
def test_over_its_bytes_the_ladder_frees_past_them_by_its_slack_and_then_waits(slack):
    tier = LadderTier(Storage(ladder=(8, 4, 2), page_size=P, group_size=P, ladder_slack=slack))
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, B, H, 6 * P, D, generator=gen)
    tier.demote(keys, values, torch.arange(6 * P).expand(B, H, -1).clone(), torch.ones(B, 6 * P, dtype=torch.bool))
    full = tier.kv_bytes()
    tier.fit(full, torch.float32)  # not over: nothing moves, whatever the slack
    assert tier.kv_bytes() == full and tier.rungs[1].num_pages == 0
    budget = full - 1
    tier.fit(budget, torch.float32)
    freed_to = budget - math.floor(slack * budget)
    saving = _page_bytes(8) - _page_bytes(4)
    assert tier.rungs[1].num_pages == math.ceil((full - freed_to) / saving)  # one page without a slack; 3 with 0.2
    assert tier.kv_bytes() <= freed_to
    held = tier.kv_bytes()
    tier.fit(held + saving // 2, torch.float32)  # the stream grows into the slack: no step-down until it is over again
    assert tier.kv_bytes() == held


def test_a_budget_below_zero_empties_the_ladder_whatever_its_slack():
    tier = LadderTier(Storage(ladder=(8, 4), page_size=P, group_size=P, ladder_slack=0.5))
    tier.demote(torch.randn(B, H, 2 * P, D), torch.randn(B, H, 2 * P, D), torch.arange(2 * P).expand(B, H, -1).clone(),
                torch.ones(B, 2 * P, dtype=torch.bool))
    tier.fit(-5, torch.float32)
    assert tier.kv_bytes() == 0

