"""The validation documents of data/default as text, for `moe-lm analyze --hf` (which tokenises text with the
checkpoint's own tokenizer): the shipped originals, found by name and hash in the data's manifest, in the val
split's order grouped by domain, as JSON lines {"text", "domain"}. With the data's own tokenizer (exported with
the checkpoint) every document gives exactly the split's ids, so the trace holds the tokens runs/d256's does.

    python docs/results/placement/val_documents.py d256_val_documents.jsonl
    python docs/results/placement/val_documents.py d256_train_documents.jsonl train    # another split
"""

import hashlib
import json
import sys

import numpy as np

from moe_lm.data.default_corpus import iter_default_corpus
from moe_lm.data.documents import ReadReport
from moe_lm.data.prepare import load_split, read_meta
from moe_lm.data.tokenizer import load_data_tokenizer

DATA = "data/default"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:16]


def main(out: str, split: str = "val") -> None:
    meta, val = read_meta(DATA), load_split(DATA, split)
    names = val.doc_names()
    # why by (name, hash): names repeat (several packages' LICENSE); the manifest records each document's hash
    corpus = iter_default_corpus(meta["signature"]["max_mb_per_domain"], ReadReport())
    texts = {(d.name, sha(d.text)): d for d in corpus}
    with open(f"{DATA}/manifest.json") as f:
        entries = [e for e in json.load(f)["documents"] if e["split"] == split]
    assert [e["name"] for e in entries] == names
    tok = load_data_tokenizer(DATA)
    same = 0
    with open(out, "w", encoding="utf-8") as f:
        for d in sorted(range(val.n_docs), key=lambda d: int(val.doc_domain[d])):  # shard order within a domain
            doc = texts[(names[d], entries[d]["sha256"])]
            same += np.asarray(val.document(d)).tolist() == [tok.doc_start_id, *tok.encode(doc.text)]
            f.write(json.dumps({"text": doc.text, "domain": doc.domain}) + "\n")
    print(f"{val.n_docs} documents, {same} with exactly the split's ids")


if __name__ == "__main__":
    main(*sys.argv[1:3])
