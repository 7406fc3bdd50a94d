"""The subjects the analytics study, one kind per file, in a registry (base.py):

    kind  flag              request      a --compare SUBJECT of it            its trace also holds     ablate  N1
    run   --run RUN[:TAG]   RunSubject   a folder with checkpoints/            weights, margins, lp     yes     init
    hf    --hf DIR          HFSubject    config.json and no checkpoints/       weights, log-probs       yes     re-init
    gguf  --gguf FILE       GGUFSubject  a regular file with GGUF's magic      weights, margins, lp     no      none
    routes --routes FILE    RecordedSubject  an engine's record (by content)   experts only             no      none

A kind declares its flag and settings, how it is recognised, what it gives, and how it loads into a `Subject` whose
`routing` satisfies moe_lm/routing/routed_model.py's `RoutedModel`. Adding a kind is one file here (its request, its
kind, `register_subject_kind`) imported below: `moe-lm analyze` then takes its flag, `--compare` recognises it, and
the recorder records it (docs/analytics.md, "Adding a kind of subject").
"""

from moe_lm.analysis.subjects import gguf, hf, recorded, run  # noqa: F401 - registers the kinds
from moe_lm.analysis.subjects.base import (  # noqa: F401 - the room's interface
    DEFAULT_WINDOWS,
    KINDS,
    Flag,
    Subject,
    SubjectKind,
    SubjectRequest,
    kind_of,
    load_subject,
    recognise,
    register_subject_kind,
    windows_of,
)
from moe_lm.analysis.subjects.gguf import GGUFSubject  # noqa: F401
from moe_lm.analysis.subjects.hf import HFSubject  # noqa: F401
from moe_lm.analysis.subjects.recorded import RecordedSubject  # noqa: F401
from moe_lm.analysis.subjects.run import RunSubject  # noqa: F401
