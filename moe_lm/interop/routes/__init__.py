"""Routes recorded by serving engines and trainers, one format per file, each recognised by its content, read as its
engine writes it and written the same way (tests, converting a moe-lm trace), in a registry (registry.py), tried in
this order:

    order  format                  file             what it reads
    10     megatron router trace   megatron.py      Megatron-Core's router_trace_rank*.jsonl with the trainer's
                                                    tokens_rank*.npy, or their folder
    20     sglang per-token dump   sglang_dumps.py  SGLang's expert_distribution_recorder_*.pt, one per rank, or their
                                                    folder
    30     vllm responses          vllm.py          vLLM's completion responses with routed_experts (JSON lines)
    40     sglang responses        sglang.py        SGLang's /generate responses with meta_info.routed_experts (JSON
                                                    lines)

`read_record(path)` reads a path with the first format that recognises it by content (else with the first that
claims it: a damaged dump is refused by the dump reader, any other file by the JSON-lines reader, each naming what is
wrong); `looks_like_record(path)` is what `--compare` asks. Each reader gives `Sequence`s: a sequence's token ids from
its first position and the experts each routed token went to, `routes` [tokens, layers of the record's axis, top_k],
in logical expert ids (record.py, with the checks every reader shares; responses.py holds what vLLM's and SGLang's
responses share). docs/analytics.md, "Routes from serving engines", names the engine versions and code these were
read from.

A new format is one file here: a `RouteFormat` (its name, order, `recognises`, `read`, `write`) and
`register_route_format`, imported below (docs/analytics.md, "Adding a record format").
"""

from moe_lm.interop.routes import megatron, sglang, sglang_dumps, vllm  # noqa: F401 - registers the formats
from moe_lm.interop.routes.record import Record, Sequence, engine_routes  # noqa: F401
from moe_lm.interop.routes.registry import (  # noqa: F401 - the room's interface
    FORMATS,
    RouteFormat,
    looks_like_record,
    read_record,
    register_route_format,
)
from moe_lm.interop.routes.responses import NO_ROUTES  # noqa: F401
