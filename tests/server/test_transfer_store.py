"""The prefill instance's store of handed-out state: fetched once, released, or expired; state
lent on the GPU is freed in the engine core exactly once, whichever comes first."""

from __future__ import annotations

import time

import pytest

from kestrel.server.disaggregation import TransferStore
from kestrel.server.metrics import ServerMetrics
from kestrel.server.protocol import ApiError


def store(timeout: float = 60.0) -> tuple[TransferStore, list[str]]:
    freed: list[str] = []
    return TransferStore(timeout, ServerMetrics("m"), freed.append), freed


def test_bytes_are_fetched_once_and_need_no_release():
    transfers, freed = store()
    transfer_id = transfers.put(b"state")
    assert transfers.take(transfer_id) == b"state"
    with pytest.raises(ApiError, match="fetched already"):
        transfers.take(transfer_id)
    assert freed == []


def test_lent_state_is_freed_when_its_decode_instance_has_copied_it():
    transfers, freed = store()
    transfer_id = transfers.put(b"{description}", export_id="prefill-1")
    assert transfers.take(transfer_id) == b"{description}"
    assert freed == []  # fetched is not copied: the decode instance maps it after this
    transfers.release(transfer_id)
    assert freed == ["prefill-1"]
    with pytest.raises(ApiError, match="released already"):
        transfers.release(transfer_id)
    assert freed == ["prefill-1"]


def test_lent_state_nobody_fetches_or_releases_expires_and_is_freed():
    transfers, freed = store(timeout=0.05)
    unfetched = transfers.put(b"{a}", export_id="prefill-1")
    fetched = transfers.put(b"{b}", export_id="prefill-2")
    transfers.take(fetched)  # its decode instance died before releasing it
    time.sleep(0.1)
    transfers.expire()
    assert sorted(freed) == ["prefill-1", "prefill-2"]
    for transfer_id in (unfetched, fetched):
        with pytest.raises(ApiError):
            transfers.release(transfer_id)
    assert sorted(freed) == ["prefill-1", "prefill-2"]


def test_a_decode_instance_may_give_up_before_fetching():
    transfers, freed = store()
    transfer_id = transfers.put(b"{a}", export_id="prefill-1")
    transfers.release(transfer_id)
    assert freed == ["prefill-1"]
    with pytest.raises(ApiError, match="fetched already"):
        transfers.take(transfer_id)
