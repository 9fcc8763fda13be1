"""The gateway's index and its routing policy, on their own: what each worker holds and which
worker a request goes to, with the failure modes the policy guards against."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.services.gateway.board import LoadBoard
from kvserve.services.gateway.index import PrefixIndex
from kvserve.services.gateway.router import Choice, Policy, choose
from kvserve.services.gateway.worker import NOT_SERVING, SERVING, Load, Worker

POLICY = Policy(page_size=4, overlap_weight=1.0, worker_queue_depth=2)
COSTED = Policy(page_size=4, overlap_weight=1.0, worker_queue_depth=10, balance_slack=10)


def worker(name: str, used: int = 0, waiting: int = 0, free: int = 100, tree: int = 10, state: str = SERVING,
           last: float = 0.0) -> Worker:
    w = Worker(name, channel=None, state=state, info=pb.ModelInfo(max_num_seqs=1, page_size=4))
    w.load = Load(running=0, waiting=waiting, free_pages=free, cached_pages=0, used_pages=used, tree_pages=tree)
    w.last_routed = last
    return w


# ------------------------------------------------------------------- index


def test_matches_count_the_leading_pages_each_worker_holds():
    index = PrefixIndex()
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2])
    index.add("c", [2, 3])          # not a prefix: its first page is missing
    assert index.matches([1, 2, 3, 4], ["a", "b", "c", "d"]) == {"a": 3, "b": 2, "c": 0, "d": 0}
    index.remove("a", [2])
    assert index.matches([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}
    index.drop("b")
    assert index.matches([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 0}
    assert index.pages_of("b") == 0 and len(index) == 3   # 1, 3 (a) and 2, 3 (c)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "drop", "replace"]), st.sampled_from("abcde"),
                          st.lists(st.integers(1, 12), max_size=5)), max_size=40),
       st.lists(st.integers(1, 12), max_size=6))
def test_the_index_agrees_with_a_plain_model_of_it(ops, query):
    """Slots freed by drops and taken again included: no bit of a worker that left survives."""
    index, model = PrefixIndex(), {w: set() for w in "abcde"}
    for op, w, hashes in ops:
        if op == "add":
            index.add(w, hashes)
            model[w] |= set(hashes)
        elif op == "remove":
            index.remove(w, hashes)
            model[w] -= set(hashes)
        elif op == "drop":
            index.drop(w)
            model[w] = set()
        else:
            index.replace(w, hashes)
            model[w] = set(hashes)
    depths = {}
    for w in "abcde":
        assert index.pages_of(w) == len(model[w])
        assert all(index.holds(w, h) == (h in model[w]) for h in range(1, 13))
        expected = 0
        for h in query:
            if h not in model[w]:
                break
            expected += 1
        depths[w] = expected
    assert index.matches(query, "abcde") == depths
    every = {w: n for w, n in depths.items() if n}
    assert index.holders(query) == every
    for most in (1, 2, 3):   # those holding the most, and no more of them
        top = index.holders(query, most=most)
        assert len(top) == min(most, len(every)) and all(every[w] == n for w, n in top.items())
        assert sorted(top.values(), reverse=True) == sorted(every.values(), reverse=True)[:most]
    assert len(index) == len(set().union(*model.values()))


# ------------------------------------------------------------------- router


def test_the_longest_cached_prefix_wins_until_load_makes_another_cheaper():
    # within the balance slack, the cost decides
    a, b = worker("a"), worker("b")
    matches = {"a": 8, "b": 0}          # a holds 32 of the 40 prompt tokens: 8 to compute against 40
    assert choose([a, b], matches, 40, COSTED, b"k", mean_request_tokens=20).worker is a
    a.load.running = 1                  # 20 tokens of load: 28 against 40, still a
    assert choose([a, b], matches, 40, COSTED, b"k", mean_request_tokens=20).worker is a
    a.load.running = 3                  # 60: 68 against 40
    assert choose([a, b], matches, 40, COSTED, b"k", mean_request_tokens=20).worker is b
    a.ended_since_report = 2            # two of those ended since the report: 28 again
    assert choose([a, b], matches, 40, COSTED, b"k", mean_request_tokens=20).worker is a


def test_no_worker_with_room_means_the_queue():
    a = worker("a", waiting=3)          # --max-num-seqs 1 + --worker-queue-depth 2 reached
    b = worker("b", free=3)             # a 40-token prompt needs 10 pages
    c = worker("c", state=NOT_SERVING)
    assert choose([a, b, c], {}, 40, POLICY, b"k") is None
    assert choose([a, b, c], {"b": 8}, 40, POLICY, b"k").worker is b   # 2 pages left to compute


def test_a_burst_of_misses_spreads_instead_of_melting_the_emptiest_worker():
    workers = [worker(n) for n in "abcd"]
    picked = []
    for i in range(8):
        choice = choose(workers, {}, 40, POLICY, f"req{i}".encode(), mean_request_tokens=40)
        picked.append(choice.worker.address)
        choice.worker.routed()     # pending until the worker's next report
    assert sorted(picked) == sorted("abcd" * 2), picked


def test_ties_go_the_same_way_for_one_conversation_and_spread_across_conversations():
    def pick(key: bytes) -> str:
        workers = [worker(n) for n in "abcd"]   # all equal: same load, same last use
        return choose(workers, {}, 40, POLICY, key).worker.address

    assert len({pick(b"conversation-1") for _ in range(5)}) == 1
    assert len({pick(f"conversation-{i}".encode()) for i in range(40)}) == 4


def test_a_cold_worker_then_the_least_recently_used_takes_a_miss():
    warm, cold = worker("warm", tree=50, last=1.0), worker("cold", tree=0, last=5.0)
    assert choose([warm, cold], {}, 40, POLICY, b"k").worker is cold
    older, newer = worker("older", last=1.0), worker("newer", last=2.0)
    assert choose([newer, older], {}, 40, POLICY, b"k").worker is older


def test_a_session_sticks_to_its_worker_while_it_has_room():
    a, b = worker("a"), worker("b")
    assert choose([a, b], {"b": 9}, 40, POLICY, b"s", sticky=a).worker is a
    a.load.waiting = 3
    assert choose([a, b], {"b": 9}, 40, POLICY, b"s", sticky=a).worker is b
    # room, however much busier than the others (the balance slack is for requests with no home)
    roomy = Policy(page_size=4, worker_queue_depth=20, balance_slack=2)
    a.load.waiting = 10
    assert choose([a, b], {"b": 9}, 40, roomy, b"s", sticky=a).worker is a
    assert choose([a, b], {"a": 9}, 40, roomy, b"s").worker is b   # without the session, the balance decides


def test_the_blind_peers_ignore_every_cache():
    import random

    from kvserve.services.gateway.router import choose_blind

    workers = [worker(n) for n in "cab"]
    assert [choose_blind(workers, 40, POLICY, "round-robin", t, None).worker.address for t in range(4)] == \
        ["a", "b", "c", "a"]
    picked = {choose_blind(workers, 40, POLICY, "random", 0, random.Random(i)).worker.address for i in range(30)}
    assert picked == {"a", "b", "c"}
    full = [worker("x", waiting=3)]
    assert choose_blind(full, 40, POLICY, "random", 0, random.Random(0)) is None


def test_no_cache_draws_everything_to_one_worker_while_others_idle():
    a, b = worker("a"), worker("b")
    policy = Policy(page_size=4, overlap_weight=100.0, worker_queue_depth=10, balance_slack=2)
    for running in range(3):            # a's cache outweighs any load, up to the slack
        a.load.running = running
        assert choose([a, b], {"a": 10}, 40, policy, b"k").worker is a
    a.load.running = 3                  # three more than b: b, whatever a holds
    assert choose([a, b], {"a": 10}, 40, policy, b"k").worker is b


def test_the_cursor_drops_a_worker_on_a_new_epoch_or_a_gap_and_follows_otherwise():
    from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
    from kvserve.services.gateway.follow import EventCursor

    def stored(n, epoch, *hashes):
        return kv_pb.Event(number=n, epoch=epoch, stored=kv_pb.PagesStored(hashes=hashes))

    index = PrefixIndex()
    cursor = EventCursor(index, "w")
    assert cursor.apply(stored(1, 7, 1)) == "an event before the snapshot"
    snapshot = kv_pb.Event(number=4, epoch=7, snapshot=kv_pb.Snapshot(pages=[kv_pb.StoredPage(hash=1)]))
    assert cursor.apply(snapshot) is None and index.pages_of("w") == 1
    assert cursor.apply(stored(5, 7, 2, 3)) is None and index.pages_of("w") == 3
    assert cursor.apply(kv_pb.Event(number=6, epoch=7, evicted=kv_pb.PagesEvicted(hashes=[3]))) is None
    assert index.pages_of("w") == 2
    assert cursor.apply(stored(8, 7, 4)) == "a gap after event 6" and index.pages_of("w") == 0
    cursor.apply(snapshot)
    assert cursor.apply(stored(1, 8, 9)) == "a new epoch" and index.pages_of("w") == 0


def test_a_large_fleet_weighs_only_the_holders_the_session_and_the_least_busy():
    from kvserve.services.gateway.router import SHORTLIST_LEAST_BUSY, shortlist

    index = PrefixIndex()
    index.add("w40", [1, 2])
    index.add("w41", [1])
    assert index.holders([1, 2, 3]) == {"w40": 2, "w41": 1} and index.holders([9]) == {} and index.holders([]) == {}
    fleet = [worker(f"w{i}") for i in range(50)]
    for i, w in enumerate(fleet):
        w.load.running = 50 - i        # the last ones are the least busy
    board = LoadBoard(fleet)
    picked = {w.address for w in shortlist(board, index.holders([1, 2, 3]), sticky=fleet[0], page_size=4)}
    assert picked == {"w0", "w40", "w41"} | {f"w{i}" for i in range(50 - SHORTLIST_LEAST_BUSY, 50)}
    assert "w49" not in {w.address for w in shortlist(board, {}, None, page_size=4, avoid=fleet[49])}
    small = fleet[:10]
    assert shortlist(LoadBoard(small), {}, None, page_size=4) == small[::-1]   # least busy first


def test_a_prompt_goes_only_to_workers_whose_model_length_leaves_it_room():
    short, long_ = worker("short"), worker("long")
    short.info.max_model_len, long_.info.max_model_len = 40, 4096
    assert choose([short, long_], {"short": 9}, 40, POLICY, b"k").worker is long_
    assert choose([short, long_], {"short": 9}, 39, POLICY, b"k").worker is short
    from kvserve.services.gateway.router import choose_blind
    assert {choose_blind([short, long_], 40, POLICY, "round-robin", t, None).worker.address for t in range(4)} == \
        {"long"}
    # the prompt fits both, its output only the long one (a fleet may mix --max-model-len)
    wants = Policy(page_size=4, overlap_weight=1.0, worker_queue_depth=2, length=508)
    assert choose([short, long_], {"short": 2}, 8, wants, b"k").worker is long_
    assert choose_blind([short, long_], 8, wants, "round-robin", 0, None).worker is long_


def test_a_salted_request_goes_only_to_a_worker_that_keeps_its_salt():
    """A worker of an older version ignores GenerateRequest.cache_salt: the request's pages would
    be shared with everyone's, so it is not sent there."""
    old, new = worker("old"), worker("new", waiting=1)
    new.info.takes_cache_salt = True
    salted = Policy(page_size=4, overlap_weight=1.0, worker_queue_depth=2, salted=True)
    assert choose([old, new], {"old": 2}, 8, salted, b"k").worker is new
    assert choose([old, new], {"old": 2}, 8, POLICY, b"k").worker is old   # unsalted: its cache and load win
    board = LoadBoard()
    board.add(old)
    assert board.never_fits(8, 9, salted=True).startswith("no serving worker takes a cache_salt")
    assert choose(board, {}, 8, salted, b"k") is None and board.never_fits(8, 9) is None
    board.add(new)
    assert board.never_fits(8, 9, salted=True) is None


def test_a_request_longer_than_every_workers_model_is_refused_as_a_worker_would():
    board = LoadBoard()
    for name, length in (("a", 256), ("b", 512)):
        w = worker(name)
        w.info.max_model_len = length
        board.add(w)
    assert board.never_fits(8, 500) is None
    assert board.never_fits(8, 600) == "prompt (8 tokens) + max_tokens (592) = 600 exceeds the model length 512"
    assert board.never_fits(8, 600, "min_tokens") == \
        "prompt (8 tokens) + min_tokens (592) = 600 exceeds the model length 512"   # max_tokens unset
    # a worker keeping attention sinks streams past its model length: it takes such a request
    sinks = worker("c")
    sinks.info.max_model_len, sinks.info.attention_sink = 512, 8
    board.add(sinks)
    assert board.never_fits(8, 600) is None
    wants = Policy(page_size=4, overlap_weight=1.0, worker_queue_depth=2, length=600)
    assert choose(board, {}, 8, wants, b"k").worker is sinks
    # ...but not min_tokens past its model length (max_tokens unset): a worker refuses that, sinks or not
    assert board.never_fits(8, 600, "min_tokens") == \
        "prompt (8 tokens) + min_tokens (592) = 600 exceeds the model length 512"
    asks = Policy(page_size=4, overlap_weight=1.0, worker_queue_depth=2, length=600, output="min_tokens")
    assert choose(board, {}, 8, asks, b"k") is None


def test_a_request_only_a_worker_off_the_board_could_take_is_worth_a_retry():
    """The board remembers what a worker that left it could take: a request only it fits is
    refused UNAVAILABLE (try again) by the gateway, not INVALID_ARGUMENT, until it is back or
    leaves the fleet."""
    from kvserve.services.gateway.worker import DOWN

    board = LoadBoard()
    short, long_ = worker("short"), worker("long")
    short.info.max_model_len, long_.info.max_model_len = 256, 512
    board.add(short)
    board.add(long_)
    assert board.never_fits(8, 500) is None and not board.fits_one_away(8, 500)
    long_.state, long_.info = DOWN, None   # as the follower marks a worker down
    long_.changed()
    assert board.never_fits(8, 500) == "prompt (8 tokens) + max_tokens (492) = 500 exceeds the model length 256"
    assert board.fits_one_away(8, 500) and not board.fits_one_away(8, 600)   # 600: not even when it is back
    long_.state, long_.info = SERVING, pb.ModelInfo(max_num_seqs=1, page_size=4, max_model_len=512)
    long_.changed()
    assert board.never_fits(8, 500) is None and not board.fits_one_away(8, 500)
    long_.state = NOT_SERVING   # draining, say: it may serve again
    long_.changed()
    assert board.fits_one_away(8, 500)
    board.remove(long_)   # gone from the fleet (its DNS name no longer lists it)
    assert not board.fits_one_away(8, 500)
    # a board built for one choice (no add) remembers nothing, even told of the worker's leaving
    one_choice = LoadBoard([short])
    short.state = DOWN
    one_choice.update(short)
    assert not one_choice.fits_one_away(8, 100)
    short.changed()   # its own board hears it
    assert board.fits_one_away(8, 100)


def test_a_worker_away_is_remembered_as_it_says_it_is_until_it_is_one_the_gateway_refuses():
    """Back up but not serving yet, a worker's own word replaces what it was; come back as one
    the gateway routes nothing to (another model, mixed tenants), it is forgotten."""
    from kvserve.services.gateway.worker import DOWN

    board = LoadBoard()
    short, other = worker("short"), worker("other")
    short.info.max_model_len, other.info.max_model_len = 64, 128
    board.add(short)
    board.add(other)
    other.state, other.info = DOWN, None
    other.changed()
    assert board.fits_one_away(8, 100) and not board.fits_one_away(8, 300)
    other.info = pb.ModelInfo(max_num_seqs=1, page_size=4, max_model_len=512)   # restarted, longer, not yet serving
    other.changed()
    assert board.fits_one_away(8, 300)
    other.state, other.excluded = NOT_SERVING, True   # it serves another model: nothing is routed there
    other.changed()
    assert not board.fits_one_away(8, 100)
    other.state, other.excluded = SERVING, False
    other.changed()
    assert board.never_fits(8, 300) is None


def test_a_failed_worker_is_chosen_again_only_when_no_other_has_room():
    """Not only when no other serves: a full one would otherwise hold the moved request, and the
    queue behind it, while the worker it left (back, or failed for that request alone) idles."""
    from kvserve.services.gateway.router import choose_blind

    a, b = worker("a"), worker("b")
    assert choose([a, b], {"a": 10}, 40, POLICY, b"k", avoid=a).worker is b
    assert choose_blind([a, b], 40, POLICY, "round-robin", 0, None, avoid=a).worker is b
    b.load.running = 50   # serving, no room
    assert choose([a, b], {"a": 10}, 40, POLICY, b"k", avoid=a) == Choice(a, 10)
    assert choose_blind([a, b], 40, POLICY, "round-robin", 0, None, avoid=a).worker is a
    b.state = NOT_SERVING
    assert choose([a, b], {"a": 10}, 40, POLICY, b"k", avoid=a).worker is a
    a.state = NOT_SERVING   # neither has room: it waits
    assert choose([a, b], {"a": 10}, 40, POLICY, b"k", avoid=a) is None
    assert choose_blind([a, b], 40, POLICY, "random", 0, None, avoid=a) is None


def test_a_sliding_window_worker_takes_prompts_longer_than_its_kv_cache():
    """It gives pages past its window back as a sequence runs, and serves any prompt its model
    length holds: the gateway refused prompts over its pages, as it does for a full-attention one."""
    full, windowed = worker("full", free=38, tree=0), worker("windowed", free=38, tree=0)
    for w in (full, windowed):
        w.info.max_model_len, w.info.num_pages = 2048, 38
    windowed.info.sliding_window = 64
    alone = LoadBoard([full])
    assert alone.never_fits(500, 510) == "the prompt has 500 tokens; the largest worker's KV cache holds 152"
    assert choose(alone, {}, 500, POLICY, b"k") is None
    board = LoadBoard([full, windowed])
    assert board.never_fits(500, 510) is None
    assert choose(board, {}, 500, POLICY, b"k").worker is windowed
    assert choose(board, {}, 100, POLICY, b"k").worker in (full, windowed)   # both have room for 25 pages


def test_a_worker_of_another_page_size_takes_what_only_it_can():
    """Requests are hashed in the fleet's smallest page size; a worker of a larger one was never
    a candidate, though the request was judged against it: one only it could take waited at the
    head of the queue for ever, and every request behind it too."""
    small, large = worker("small"), worker("large")
    small.info.max_model_len = 128
    large.info.page_size, large.info.max_model_len = 8, 512
    board = LoadBoard([small, large])
    wants = Policy(page_size=4, overlap_weight=1.0, worker_queue_depth=2, length=205)
    assert board.never_fits(200, 205) is None
    assert choose(board, {}, 200, wants, b"k").worker is large
    from kvserve.services.gateway.router import choose_blind
    assert choose_blind(board, 200, wants, "round-robin", 0, None).worker is large
    busy = worker("busy", waiting=6)   # a short request goes to the idle one, whatever its page size
    assert choose(LoadBoard([busy, large]), {}, 8, POLICY, b"k").worker is large


def test_a_request_every_worker_refuses_for_a_reason_of_its_own_is_refused():
    """One worker streams past its length (sinks) but its length leaves no room for the prompt;
    the other takes the prompt but not its output: checked against the fleet as a whole, the
    request was neither routed nor refused."""
    sinks, longer = worker("sinks"), worker("longer")
    sinks.info.max_model_len, sinks.info.attention_sink = 64, 4
    longer.info.max_model_len = 128
    board = LoadBoard([sinks, longer])
    assert board.never_fits(100, 200) == "prompt (100 tokens) + max_tokens (100) = 200 exceeds the model length 128"
    assert board.never_fits(60, 200) is None   # the sinks' worker takes it


def test_a_worker_busy_with_a_long_prefill_is_further_from_a_first_token_than_its_sequences_say():
    a, b = worker("a"), worker("b")
    matches = {"a": 8, "b": 0}          # 8 tokens to compute at a, 40 at b
    assert choose([a, b], matches, 40, COSTED, b"k").worker is a
    a.load.prefill_tokens = 100         # its report: a prompt of 100 tokens in its running step
    assert choose([a, b], matches, 40, COSTED, b"k").worker is b
    a.load.prefill_tokens = 0           # done: a again
    assert choose([a, b], matches, 40, COSTED, b"k").worker is a
    mark = a.routed(prefill=64)         # this gateway just sent it one: ahead of the next until done
    assert choose([a, b], matches, 40, COSTED, b"k").worker is b
    a.prefilled(mark)
    assert choose([a, b], matches, 40, COSTED, b"k").worker is a


def test_a_request_sent_and_not_yet_taken_counts_once_by_its_own_prompt():
    """Both batches full: `a` has two requests of 20 prompt tokens this gateway just sent, `b` two
    waiting by its report, of a size the gateway knows only as the average (100). `a`'s two count
    by their prompts (in the prefill ahead), not also as queued requests of the average size."""
    a, b = worker("a"), worker("b", waiting=2)
    a.load.running = b.load.running = 1
    marks = [a.routed(prefill=20), a.routed(prefill=20)]
    assert (a.active, a.untaken, a.prefill_backlog, b.active, b.untaken) == (3, 2, 40, 3, 0)
    matches = {"a": 8, "b": 0}   # 8 tokens to compute at a, 40 at b
    # a: 8 + 40 ahead + a running sequence's page; b: 40 + two average prompts + a page
    assert choose([a, b], matches, 40, COSTED, b"k", mean_request_tokens=100).worker is a
    for mark in marks:           # taken: the worker's own queue has them, its next report counts them
        mark.take()
    assert (a.active, a.untaken) == (3, 0)


def test_the_prefill_ahead_follows_reports_and_this_gateways_own_streams():
    w = worker("w")
    mark = w.routed(prefill=800)
    assert w.prefill_backlog == 800     # sent since its last report
    mark.take()                         # the worker has it: its report counts it once a step runs it
    w.loaded(Load(free_pages=100, asked_at=mark.taken_at - 1, prefill_tokens=800))   # running before the take's report
    assert w.prefill_backlog == 800     # not twice
    w.loaded(Load(free_pages=100, asked_at=mark.taken_at + 1))   # a report after the take, the step not begun
    assert w.prefill_backlog == 800     # at least this gateway's own, not yet prefilled
    w.loaded(Load(free_pages=100, asked_at=mark.taken_at + 2, prefill_tokens=900))   # running, with another's 100
    assert w.prefill_backlog == 900
    w.prefilled(mark)                   # its prefill_done: the report's 900 less its 800
    assert w.prefill_backlog == 100 and w.prefilling == 0
    w.prefilled(mark)                   # once only
    assert w.prefill_backlog == 100
    w.loaded(Load(free_pages=100, asked_at=mark.taken_at + 3))
    assert w.prefill_backlog == 0
    left = w.routed(prefill=300)        # a stream that leaves before its prefill_done
    w.ended(left)
    assert w.prefill_backlog == 0 and w.prefilling == 0


def test_when_the_least_busy_few_cannot_take_a_request_a_worker_further_down_that_can_does():
    """Only the least busy few and the prompt's holders were weighed: with the idle workers
    all of too short a model (or without pages), a long prompt found no worker with room and
    waited at the queue's head, holding everyone behind it, while busier workers could take it."""
    from kvserve.services.gateway.router import SHORTLIST_LEAST_BUSY
    short = [worker(f"short{i}") for i in range(2 * SHORTLIST_LEAST_BUSY)]
    for w in short:
        w.info.max_model_len = 2048
    long_ = [worker(f"long{i}") for i in range(2 * SHORTLIST_LEAST_BUSY)]
    for w in long_:
        w.info.max_model_len, w.load.running, w.load.free_pages = 32768, 1, 4000
    board = LoadBoard(short + long_)
    choice = choose(board, {}, 8000, Policy(page_size=4, worker_queue_depth=2), b"k")
    assert choice is not None and choice.worker in long_
    # the walk is the gateway's to ration (a fleet full by its pages would be walked at each report)
    assert choose(board, {}, 8000, Policy(page_size=4, worker_queue_depth=2), b"k", widen=False) is None
    for w in long_:   # every worker busy past its batch and queue: no scan finds room, none is made up
        w.load.running = 3
        board.update(w)
    assert choose(board, {}, 8000, Policy(page_size=4, worker_queue_depth=2), b"k") is None


def test_a_prefix_every_worker_holds_weighs_its_deepest_holders_and_the_least_busy_not_the_whole_fleet():
    """A shared system prompt is held by every warm worker: each request weighed all of them,
    an O(fleet) choice. The index names the deepest holders alone; the least busy few are
    weighed with what they hold, asked of the index for them."""
    from kvserve.services.gateway.router import SHORTLIST_HOLDERS
    index, fleet = PrefixIndex(), [worker(f"w{i:03}") for i in range(200)]
    for i, w in enumerate(fleet):
        index.add(w.address, [1, 2, 3])   # the shared prompt's pages
        w.load.running = 200 - i          # the last ones are the least busy
    index.add("w007", [1, 2, 3, 4, 5])    # one conversation's worker
    hashes = [1, 2, 3, 4, 5, 6]
    matches = index.holders(hashes, most=SHORTLIST_HOLDERS)
    assert len(matches) == SHORTLIST_HOLDERS and matches["w007"] == 5
    asked = []

    def depths(addresses):
        asked.extend(addresses)
        return index.matches(hashes, addresses)

    policy = Policy(page_size=4, overlap_weight=1.0, worker_queue_depth=500, balance_slack=500)
    choice = choose(LoadBoard(fleet), matches, 24, policy, b"k", mean_request_tokens=24, depths=depths)
    assert 0 < len(asked) <= 8 and all(index.matches(hashes, [a])[a] == 3 for a in asked)
    # the idle one (the conversation's worker has 190 requests queued), its 3 pages known
    assert choice.worker.address == "w199" and choice.matched_pages == 3


def test_holders_the_gateway_would_not_route_to_do_not_take_the_deepest_places():
    """The index names a bounded number of the deepest holders; draining workers that still
    hold the prompt (a rolling restart) took those places, and the serving holder behind them
    was weighed as holding nothing."""
    from kvserve.services.gateway.fleet import Fleet
    from kvserve.services.gateway.router import SHORTLIST_HOLDERS
    from kvserve.services.gateway.waiting import WaitQueue

    fleet = Fleet("", 1.0, 2, 10.0, WaitQueue(8))
    ids = list(range(3, 27))   # 6 pages of 4
    hashes = fleet.hashes(ids, "", 4)

    def joined(name: str, state: str, running: int, held: int) -> None:
        w = worker(name, state=state)
        w.info.max_num_seqs, w.info.max_model_len, w.info.num_pages = 4, 1000, 100
        w.load.running, w.events_live = running, True
        fleet.workers[name] = w
        fleet.board.add(w)
        if held:
            fleet.index.add(name, hashes[:held])

    for i in range(SHORTLIST_HOLDERS + 4):   # the lowest slots: draining, holding all but the last page
        joined(f"draining{i:02}", NOT_SERVING, 0, 5)
    joined("home", SERVING, 2, 5)            # serving, busy, holding as much
    for i in range(20):   # more than the board weighs whole: only the least busy 8 of them
        joined(f"idle{i:02}", SERVING, 0, 0)
    choice = fleet.choose(ids, hashes, "")
    assert choice.worker.address == "home" and choice.matched_pages == 5


def test_new_sessions_sharing_a_system_prompt_spread_over_the_workers_holding_it():
    """A session this replica has not routed sticks to the worker holding more of its prompt
    than any other. New sessions' prompts share only a system prompt every warm worker holds as
    deep: the tie went by address, and every new user went to one worker (past the balance)
    while the others idled. Workers holding as much are no sign of a home: the cost decides."""
    from collections import Counter

    from kvserve.services.gateway.fleet import Fleet, session_key
    from kvserve.services.gateway.waiting import WaitQueue

    fleet = Fleet("", 1.0, 2, 0.05, WaitQueue(100))
    system = list(range(1000, 1040))   # 10 pages of 4, held by every worker
    names = [f"w{i:02}" for i in range(32)]   # more than the index names as the deepest holders
    for name in names:
        w = worker(name)
        w.info.max_num_seqs, w.info.max_model_len, w.info.num_pages = 64, 4096, 4096
        w.events_live = True
        fleet.workers[name] = w
        fleet.board.add(w)
        fleet.index.add(name, fleet.hashes(system, "", 4))
    chosen = Counter()
    for s in range(320):
        ids = system + [500 + s] * 12
        chosen[fleet.choose(ids, fleet.hashes(ids, "", 4), session_key("", f"user-{s}")).worker.address] += 1
    assert set(chosen) == set(names) and max(chosen.values()) - min(chosen.values()) <= 8, chosen
    # one worker holding more of a session's prompt than any other is its home
    ids = system + [9] * 12
    fleet.index.add("w20", fleet.hashes(ids, "", 4))
    assert fleet.choose(ids, fleet.hashes(ids, "", 4), session_key("", "returning")).worker.address == "w20"
