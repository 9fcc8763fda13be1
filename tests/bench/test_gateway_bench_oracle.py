"""bench/gateway_bench.py's oracle: a prompt's hits are its leading full pages that some earlier
prefill or reply computed, never the page of its last token."""

from __future__ import annotations

from bench.gateway_bench import Oracle


def test_the_oracle_counts_the_longest_computed_prefix_in_whole_pages():
    oracle = Oracle(page_size=4)
    system = list(range(100, 110))                      # two full pages and two tokens
    assert oracle.hits(system + [1, 2, 3]) == 0          # nothing computed yet
    oracle.add(system + [1, 2])                          # a first prefill: three full pages
    assert oracle.hits(system + [7, 8, 9, 10, 11]) == 8  # the system prompt's two pages; the third differs
    assert oracle.hits(system + [1, 2, 5, 6, 7]) == 12   # all three
    assert oracle.hits(system + [1, 2]) == 8             # the last token's page is always computed
    assert oracle.hits([99] + system[1:] + [1, 2, 5]) == 0   # a first page that differs: nothing after it counts
