"""Planner decisions with no model: budget, chunking, seat limit, FCFS, preemption order."""

from __future__ import annotations

from kestrel.core.planner import Capacity, FcfsPlanner, PlannerConfig, QueueState, RequestView

PAGE = 4


def view(request_id: str, num_tokens: int, computed: int = 0, pages: int | None = None) -> RequestView:
    held = pages if pages is not None else -(-computed // PAGE)
    return RequestView(request_id, num_tokens, computed, held)


def plan(waiting=(), running=(), budget=16, seqs=8, free_pages=100):
    planner = FcfsPlanner(PlannerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs))
    return planner.plan(QueueState(tuple(waiting), tuple(running)), Capacity(free_pages, PAGE))


def test_token_budget_chunks_a_long_prompt():
    result = plan(waiting=[view("a", 40)], budget=16)
    assert [(c.request_id, c.num_new_tokens) for c in result.scheduled] == [("a", 16)]
    assert result.admitted == ("a",)


def test_running_decodes_go_first_and_prefill_fills_the_rest():
    running = [view("a", 11, computed=10), view("b", 21, computed=20)]
    result = plan(waiting=[view("c", 40)], running=running, budget=16)
    assert [(c.request_id, c.num_new_tokens) for c in result.scheduled] == [("a", 1), ("b", 1), ("c", 14)]
    assert result.num_tokens == 16


def test_continuing_prefill_chunk_resumes_where_it_stopped():
    result = plan(running=[view("a", 40, computed=16)], budget=16)
    chunk = result.scheduled[0]
    assert (chunk.num_computed_tokens, chunk.num_new_tokens) == (16, 16)


def test_fcfs_head_of_queue_is_never_overtaken():
    # "a" needs 10 pages, only 5 free: "b" (1 page) must wait behind it.
    result = plan(waiting=[view("a", 40), view("b", 2)], budget=64, free_pages=5)
    assert result.scheduled == ()
    result = plan(waiting=[view("a", 8), view("b", 2)], budget=64, free_pages=5)
    assert [c.request_id for c in result.scheduled] == ["a", "b"]


def test_max_num_seqs_caps_running_requests():
    running = [view("a", 5, computed=4)]
    result = plan(waiting=[view("b", 3), view("c", 3)], running=running, seqs=2)
    assert [c.request_id for c in result.scheduled] == ["a", "b"]
    assert result.admitted == ("b",)


def test_preemption_takes_the_newest_running_request_first():
    # Three decodes each at a page boundary need one new page; only one page is free.
    running = [view("a", 9, 8, 2), view("b", 9, 8, 2), view("c", 9, 8, 2)]
    result = plan(running=running, free_pages=1, waiting=[view("d", 2)])
    assert result.preempted == ("c",)
    assert [c.request_id for c in result.scheduled] == ["a", "b"]
    assert result.admitted == ()  # nothing is admitted in a step that had to preempt


def test_a_request_preempts_itself_when_it_is_the_newest():
    running = [view("a", 9, 8, 2)]
    result = plan(running=running, free_pages=0)
    assert result.preempted == ("a",)
    assert result.scheduled == ()


def test_budget_exhausted_leaves_later_running_requests_for_next_step():
    running = [view("a", 40, computed=0, pages=0), view("b", 5, computed=4)]
    result = plan(running=running, budget=16)
    assert [(c.request_id, c.num_new_tokens) for c in result.scheduled] == [("a", 16)]
    assert result.preempted == ()


def test_admission_leaves_a_page_of_headroom_per_running_request():
    # Two decodes hold room for now; "v" (a preempted request, 2 pages) would fit in 3 free
    # pages, but then the running two could not grow without preempting it again.
    running = [view("x", 6, 5, 2), view("y", 6, 5, 2)]
    assert plan(running=running, waiting=[view("v", 8)], free_pages=3).admitted == ()
    assert plan(running=running, waiting=[view("v", 8)], free_pages=4).admitted == ("v",)


def test_lookahead_tokens_reserve_pages_past_each_chunk():
    """With room for 3 draft tokens a decode at a page's last slot needs a second page, and
    the capacity accounting charges it."""
    planner = FcfsPlanner(PlannerConfig(max_num_batched_tokens=16, max_num_seqs=8, num_lookahead_tokens=3))
    running = (view("a", 4, computed=3), view("b", 9, computed=8))
    result = planner.plan(QueueState((), running), Capacity(2, PAGE))
    assert [(c.request_id, c.num_new_pages) for c in result.scheduled] == [("a", 1), ("b", 1)]
    tight = planner.plan(QueueState((), running), Capacity(1, PAGE))
    assert tight.preempted == ("b",)  # without lookahead both would have fitted in one page
    plain = plan(running=running, free_pages=1)
    assert plain.preempted == () and [c.num_new_pages for c in plain.scheduled] == [0, 1]


def test_chunks_stop_at_every_snapshot_interval():
    """A hybrid model's prefix cache keeps the recurrent state where chunks end: no chunk
    crosses a multiple of the interval, whatever the budget leaves."""
    planner = FcfsPlanner(PlannerConfig(max_num_batched_tokens=64, max_num_seqs=8, snapshot_interval=8))
    waiting = (view("fresh", 30), view("resumed", 30, computed=5, pages=2), view("decode", 41, computed=40))
    result = planner.plan(QueueState(waiting, ()), Capacity(100, PAGE))
    assert [(c.request_id, c.num_new_tokens) for c in result.scheduled] == [("fresh", 8), ("resumed", 3), ("decode", 1)]
    ends = [c.num_computed_tokens + c.num_new_tokens for c in result.scheduled]
    assert ends[:2] == [8, 8]


def test_a_running_request_with_nothing_left_to_compute_gets_no_chunk():
    # A prompt-only request (a prefill instance's) whose last chunk is launched but not read yet.
    result = plan(running=[view("done", 12, computed=12), view("b", 21, computed=20)], budget=16)
    assert [(c.request_id, c.num_new_tokens) for c in result.scheduled] == [("b", 1)]
