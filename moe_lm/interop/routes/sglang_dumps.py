"""SGLang's per-token expert dumps, recognised, read and written as SGLang's recorder writes them.

Read from SGLang 0.5.23, `srt/eplb/expert_distribution.py` (as stored at 02295fe5): with
`--expert-distribution-recorder-mode per_token`, `/dump_expert_distribution_record` makes each rank
`torch.save` {records: [per forward pass: forward_pass_id, rank, gatherer_key, input_ids, positions,
extend_seq_lens, forward_mode, topk_ids_of_layer [num_layers, tokens, 8] int32, misc_objects,
global_physical_count], last_physical_to_logical_map [num_layers, physical experts]} as
`expert_distribution_recorder_{time}_{rank}.pt` (`_DetailSinglePassGatherer`, `_DetailAccumulator.dump`). Ids are
physical slots, mapped to logical here by the dump's own map; the gatherer resets its buffer to -1 every pass, so -1
fills dense layers (never routed) and the columns past top_k. `extend_seq_lens` is the pass's ForwardBatch
`extend_seq_lens_cpu`: the lengths of its requests' segments in a prefill, None in a decode step.

A pass holds several requests' tokens; a document here is a prefill segment that starts at position 0 (a decode
step, or a prefill continuing a cached prefix, lacks its request's earlier tokens: counted, not read). Every rank of
plain tensor parallelism records the same passes under the same forward_pass_id: a pass another rank's file holds
too is read once; within one rank's file every pass is read, equal or not (the same prompt prefilled twice is two
sequences).
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np

from moe_lm.errors import DataError, shown
from moe_lm.interop.routes.record import Record, Sequence, int_array, integer, is_int, open_regular
from moe_lm.interop.routes.registry import RouteFormat, register_route_format

SGLANG_TOPK_COLUMNS = 8  # the per-token recorder's fixed width (_TOP_K_NUM); columns past top_k are -1
FILLER = -1  # SGLang's per-token recorder: dense layers, unused columns
DUMP_GLOB = "expert_distribution_recorder_*.pt"
DECODE = "decode steps"
CONTINUED = "prefills continuing a cached or earlier chunk"
PAST_SEGMENTS = "tokens past their pass's extend_seq_lens"
SNIFF_BYTES = 1 << 24  # the first record's keys lie within its input_ids and positions (a pass's tokens) of the start


def is_sglang_dump(path: Path) -> bool:
    """Whether `path` is a per-token dump by its content, whatever its name: a torch.save zip whose pickle names a
    pass's `topk_ids_of_layer` and `extend_seq_lens` (read from the zip's data.pkl as bytes: nothing is unpickled,
    and no more than SNIFF_BYTES of it)."""
    try:
        f = open_regular(path)
    except DataError:
        return False
    with f:
        if f.read(2) != b"PK":
            return False
        try:
            with zipfile.ZipFile(f) as archive:
                pickle = next((n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"), None)
                if pickle is None:
                    return False
                with archive.open(pickle) as data:
                    head = data.read(SNIFF_BYTES)
        except (zipfile.BadZipFile, OSError, EOFError, RuntimeError, ValueError):
            return False
    return b"topk_ids_of_layer" in head and b"extend_seq_lens" in head


def read_sglang_dumps(paths: list[Path]) -> Record:
    """Every rank's dump of one recording: each rank's passes, physical ids mapped by its own map; a pass another
    rank's file holds too (plain tensor parallelism: every rank routes every token) is read once."""
    sequences: list[Sequence] = []
    skipped: dict[str, int] = {}
    seen: dict[tuple, int] = {}  # (forward_pass_id, digest of the pass) -> the file that held it first
    for file_index, path in enumerate(paths):
        records, phys_to_log = _load(path)
        for i, rec in enumerate(records):
            if not isinstance(rec, dict):
                raise DataError(f"{path}, record {i}: not a dict of a forward pass's fields")
            where = f"{path}, forward pass {shown(rec.get('forward_pass_id', i))}"
            ids, positions, topk, lens = _pass_fields(rec, where)
            key = (rec.get("forward_pass_id"), _digest(ids, positions, topk))
            if seen.setdefault(key, file_index) != file_index:
                continue  # another rank recorded the same pass
            sequences += _dump_pass(ids, positions, topk, lens, phys_to_log, where, skipped)
    return Record("sglang per-token dump", sequences, skipped, filler=FILLER)


def _load(path: Path) -> tuple[list, np.ndarray]:
    """The dump's records and its physical-to-logical map [layers, slots]; torch.load with weights_only (no pickled
    code runs: a dump holds dicts, lists, numbers and tensors)."""
    import torch

    with open_regular(path) as f:
        try:
            dump = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch.load raises many kinds for a damaged or foreign file
            raise DataError(f"{path}: not a readable torch.save file ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("records"), list) or "last_physical_to_logical_map" \
            not in dump:  # fmt: skip
        raise DataError(f"{path}: not an SGLang per-token dump (a list of records, last_physical_to_logical_map)")
    phys_to_log = int_array(dump["last_physical_to_logical_map"], "last_physical_to_logical_map", str(path), 2)
    if phys_to_log.size and phys_to_log.min() < 0:
        raise DataError(f"{path}: last_physical_to_logical_map holds {int(phys_to_log.min())}, not expert ids")
    return dump["records"], phys_to_log


def _pass_fields(rec: dict, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int] | None]:
    """input_ids, positions, topk_ids_of_layer [layers, tokens, columns] and extend_seq_lens (None: a decode step),
    each checked against the others."""
    for name in ("input_ids", "positions", "topk_ids_of_layer"):
        if name not in rec:
            raise DataError(f"{where}: no {name} (SGLang's per-token recorder writes it for every pass)")
    ids = int_array(rec["input_ids"], "input_ids", where, 1)
    positions = int_array(rec["positions"], "positions", where, 1)
    topk = int_array(rec["topk_ids_of_layer"], "topk_ids_of_layer", where, 3)
    if topk.shape[1] != len(ids) or len(positions) != len(ids):
        raise DataError(f"{where}: topk_ids_of_layer {tuple(topk.shape)} does not fit its {len(ids)} input_ids and "
                        f"{len(positions)} positions")  # fmt: skip
    if ids.size and (ids.min() < 0 or positions.min() < 0):
        raise DataError(f"{where}: a negative token id or position")
    if topk.size and topk.min() < FILLER:
        raise DataError(f"{where}: expert slot {int(topk.min())}: neither a slot nor SGLang's filler -1")
    lens = rec.get("extend_seq_lens")
    if lens is not None:
        if not isinstance(lens, list) or not all(is_int(n) and n >= 0 for n in lens) or sum(lens) > len(ids):
            raise DataError(f"{where}: extend_seq_lens {str(lens)[:60]} are not segment lengths within its "
                            f"{len(ids)} tokens")  # fmt: skip
    integer(rec.get("forward_pass_id", 0), "forward_pass_id", where)  # why: it names the pass across ranks
    return ids, positions, topk, lens


def _digest(*arrays: np.ndarray) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.digest()


def _dump_pass(ids, positions, topk, lens, phys_to_log, where: str, skipped: dict) -> list[Sequence]:
    """The pass's prefill segments from position 0 as sequences, their slots mapped to logical ids; the rest
    counted in `skipped` by why."""
    if phys_to_log.shape[0] != topk.shape[0]:
        raise DataError(f"{where}: last_physical_to_logical_map {tuple(phys_to_log.shape)} does not cover its "
                        f"{topk.shape[0]} layers")  # fmt: skip
    if topk.max(initial=FILLER) >= phys_to_log.shape[1]:
        raise DataError(f"{where}: expert slot {int(topk.max())} past the map's {phys_to_log.shape[1]} physical slots")
    logical = np.where(topk >= 0, np.take_along_axis(phys_to_log[:, None, :], topk.clip(0), axis=2), FILLER)
    routes = logical.transpose(1, 0, 2)  # [tokens, layers, 8]
    if lens is None:  # a decode step: a token per request, each without its request's earlier tokens
        _count(skipped, DECODE, len(ids))
        return []
    out, at = [], 0
    for n in lens:
        if n and positions[at] == 0:
            out.append(Sequence(ids[at : at + n], routes[at : at + n]))
        else:
            _count(skipped, CONTINUED, n)
        at += n
    _count(skipped, PAST_SEGMENTS, len(ids) - at)  # why said: the recorder's tokens past them name no request
    return out


def _count(skipped: dict, why: str, n: int) -> None:
    if n:
        skipped[why] = skipped.get(why, 0) + n


def sglang_dump(passes: list[tuple[np.ndarray, np.ndarray]], phys_to_log: np.ndarray, rank: int = 0) -> dict:
    """An SGLang per-token dump of prefill passes, each (tokens, physical ids [layers, tokens, k] with -1 in dense
    layers) one request from position 0, as the recorder saves it."""
    import torch

    records = []
    for i, (tokens, ids) in enumerate(passes):
        topk = np.full((ids.shape[0], len(tokens), SGLANG_TOPK_COLUMNS), FILLER, dtype=np.int32)
        topk[:, :, : ids.shape[2]] = ids
        records.append({"forward_pass_id": i, "rank": rank, "gatherer_key": "primary",
                        "input_ids": tokens.tolist(), "positions": list(range(len(tokens))),
                        "extend_seq_lens": [len(tokens)], "forward_mode": 1,
                        "topk_ids_of_layer": torch.from_numpy(topk), "misc_objects": [],
                        "global_physical_count": torch.zeros(phys_to_log.shape, dtype=torch.int64)})  # fmt: skip
    return {"records": records, "last_physical_to_logical_map": torch.from_numpy(phys_to_log.astype(np.int64))}


class SGLangDumps(RouteFormat):
    name = "sglang per-token dump"
    looks_like = "SGLang's per-token dumps, expert_distribution_recorder_*.pt (one per rank) or their folder"
    order = 20

    def recognises(self, path: Path) -> bool:
        return any(path.glob(DUMP_GLOB)) if path.is_dir() else is_sglang_dump(path)

    def claims(self, path: Path) -> bool:
        """A torch.save zip (its reader says what of a dump it lacks)."""
        try:
            f = open_regular(path)
        except DataError:
            return False
        with f:
            return f.read(2) == b"PK"

    def read(self, path: Path) -> Record:
        if not path.is_dir():
            return read_sglang_dumps([path])
        dumps = sorted(path.glob(DUMP_GLOB))
        if not dumps:
            raise DataError(f"{path}: no {DUMP_GLOB} files (SGLang's per-token dumps) in it")
        return read_sglang_dumps(dumps)

    def write(self, path: Path, record: Record, phys_to_log: np.ndarray | None = None, rank: int = 0) -> None:
        """Each sequence a prefill pass from position 0, its logical ids (-1 in dense layers) written as the first
        slot of each expert in `phys_to_log` [layers, slots] (None: slot e holds expert e)."""
        import torch

        routes = [s.routes for s in record.sequences]
        if phys_to_log is None:
            experts = 1 + max(int(r.max(initial=0)) for r in routes)
            phys_to_log = np.tile(np.arange(experts), (routes[0].shape[1], 1))
        first_slot = np.stack([np.argmax(phys_to_log == e, axis=1) for e in range(int(phys_to_log.max()) + 1)], axis=1)
        passes = []
        for s, r in zip(record.sequences, routes, strict=True):
            physical = np.where(r >= 0, np.take_along_axis(first_slot[None], r.clip(0), axis=2), FILLER)
            passes.append((s.tokens, physical.transpose(1, 0, 2)))
        torch.save(sglang_dump(passes, phys_to_log, rank), path)


register_route_format(SGLangDumps())
