"""Table announcements: what this engine tells each linked peer about its regions, caches and keys.

A peer learns this engine's tables as a full announcement when its link is set up, then as the
differences since the last announcement whenever memory changes (``MemoryManager``'s change
listener).  Each link's :class:`~llmdd._protocol.tables.TableAnnouncer` keeps what was
announced; :class:`Announcements` reads the memory tables, computes the differences and sends
them.  Every announcement runs on the registrar thread (one at a time, in order, with no lock
held), and the endpoints' grant covers what an announcement names before it leaves.
"""

from __future__ import annotations

from llmdd._base.log import get_logger
from llmdd._base.status import LLMException
from llmdd._control.endpoints import Registrar, TransportEndpoints
from llmdd._control.link import Link
from llmdd._protocol import messages as m
from llmdd._protocol.codec import ProtocolError
from llmdd._control.table import LinkTable
from llmdd._memory.manager import MemoryManager

__all__ = ["Announcements"]

_log = get_logger("llmdd.link")


class Announcements:
    """This engine's tables, announced to every linked peer."""

    def __init__(self, *, memory: MemoryManager, endpoints: TransportEndpoints, registrar: Registrar,
                 table: LinkTable) -> None:
        self._memory = memory
        self.endpoints = endpoints
        self._registrar = registrar
        self._table = table

    def _local_tables(self) -> tuple[dict, dict, dict]:
        """Current regions, caches and keys of this engine, in wire form."""
        memory = self._memory
        # memory peers may not access is not announced at all: they cannot even learn it exists
        regions = {r.region_id: self.endpoints.region_descriptor(r) for r in memory.regions.regions() if self.endpoints.granted(r)}
        caches: dict[int, m.CacheEntry] = {}
        keys: dict[m.KeyRef, m.KeyEntry] = {}
        for rec in memory.records():
            if not rec.live and not rec.release_pending:
                continue
            if not any(self.endpoints.granted(r) for r in rec.regions):
                continue
            caches[rec.cache_id] = m.CacheEntry(
                cache_id=rec.cache_id, addrs=tuple(rec.addrs), tensor_size=rec.tensor_size,
                shape=tuple(int(x) for x in rec.desc.shape), data_type=rec.desc.data_type.value,
                placement=rec.placement, is_blocks=rec.is_blocks)
            if rec.blocks_model_id is not None and rec.live:
                ref = m.KeyRef.for_blocks(rec.blocks_model_id)
                keys[ref] = m.KeyEntry(key=ref, cache_id=rec.cache_id, batch_index=0)
        for index, (cache_id, batch_index) in memory.key_items():
            if cache_id not in caches:
                continue
            ref = _index_to_ref(index)
            keys[ref] = m.KeyEntry(key=ref, cache_id=cache_id, batch_index=batch_index)
        return regions, caches, keys

    def _announce(self, link: Link, regions: dict, caches: dict, keys: dict, *, full: bool = False) -> None:
        # the grant covers what this announcement names before the peer can learn it (a removed region is
        # already deregistered from every endpoint)
        self.endpoints.grant(link, regions)
        ann = link.announcer
        done = ann.announced
        updates: list[m.Message]
        if full:
            updates = [ann.regions_update(added=regions.values(), full=True),
                       ann.cache_table_update(caches_added=caches.values(), keys_added=keys.values(), full=True)]
        else:
            old_r, old_c, old_k = done.regions, done.caches, done.keys
            r_added = [d for rid, d in regions.items() if old_r.get(rid) != d]
            r_removed = [rid for rid in old_r if rid not in regions or old_r[rid] != regions[rid]]
            c_added = [e for cid, e in caches.items() if old_c.get(cid) != e]
            c_removed = [cid for cid in old_c if cid not in caches or old_c[cid] != caches[cid]]
            k_removed = [k for k, e in old_k.items() if keys.get(k) != e and e.cache_id not in c_removed]
            k_added = [e for k, e in keys.items() if old_k.get(k) != e or e.cache_id in c_removed]
            updates = []
            if r_added or r_removed:
                updates.append(ann.regions_update(added=r_added, removed=r_removed))
            if c_added or c_removed or k_added or k_removed:
                updates.append(ann.cache_table_update(caches_added=c_added, caches_removed=c_removed,
                                                      keys_added=k_added, keys_removed=k_removed))
        for update in updates:
            link.control.send(update)

    def announce_all(self) -> None:
        """Send every linked peer what changed in this engine's regions, caches and keys."""
        self._registrar.call(self._announce_all)

    def _announce_all(self) -> None:
        links = self._table.announced_to()
        if not links:
            return
        regions, caches, keys = self._local_tables()
        for link in links:
            if link.announcer.announced.regions_version == 0:
                continue  # initial full tables not sent yet: they will carry this change
            try:
                self._announce(link, regions, caches, keys)
            except (ProtocolError, LLMException) as exc:
                _log.warning("llmdd.link.announce_failed", peer=link.peer_cluster_id, error=str(exc))

    def send_initial_tables(self, link: Link) -> None:
        """The full tables to a link being set up (before it is LINKED on the peer's side)."""
        def send() -> None:
            regions, caches, keys = self._local_tables()
            self._announce(link, regions, caches, keys, full=True)

        self._registrar.call(send)


def _index_to_ref(index) -> m.KeyRef:
    """Memory's CacheKey index ``(req_id or prefix_id, model_id)`` as a wire KeyRef.

    Upstream keeps req ids and prefix ids in one index space, so does llmdd: the
    puller computes the same index from its ``CacheKey`` and looks up a REQ ref.
    """
    return m.KeyRef.for_req(index[0], index[1])
