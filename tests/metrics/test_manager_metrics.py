"""The manager's series about its model service's link: a dead model service's sequences stay
counted as used until a new epoch registers (a live one reconnecting keeps its epoch and needs
them), so kv_step_streams tells whether the pages are a live one's."""

from __future__ import annotations

from kvserve.kvcache_service.contract.client import RemoteKVClient
from kvserve.kvcache_service.contract.types import StepRequest
from kvserve.kvcache_service.core import ManagerConfig
from kvserve.kvcache_service.config import KVCacheServerConfig
from kvserve.kvcache_service.server import _create_with_servicer
from tests.server_thread import LoopThread
from tests.service.util import wait_until


def test_the_open_step_streams_are_counted_and_a_gone_link_reads_0():
    loop = LoopThread("manager")
    try:
        running, _, metrics = loop.call(_create_with_servicer("127.0.0.1:0", ManagerConfig(num_pages=64, page_size=4),
                                                              KVCacheServerConfig()))
        def open_streams() -> float:
            return metrics.registry.get_sample_value("kvserve:kv_step_streams")
        client = RemoteKVClient(running.address)
        client.register(epoch=7, page_size=4, num_pages=64)
        assert open_streams() == 0   # registered, no Step yet
        client.send_step(StepRequest(epoch=7))()
        assert open_streams() == 1
        client.close()   # the model service gone
        wait_until(lambda: open_streams() == 0, what="the closed stream counted out")
        loop.call(running.server.stop(None))
    finally:
        loop.close()
