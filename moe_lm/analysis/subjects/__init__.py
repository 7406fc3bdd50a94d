"""The subjects the analytics study, one kind per file, in a registry (base.py):

    kind    flag              request        a --compare SUBJECT of it          its trace also holds   ablate  N1
    run     --run RUN[:TAG]   RunSubject     a folder with checkpoints/         weights, margins, lp   yes     init
    hf      --hf DIR          HFSubject      config.json and no checkpoints/    weights, log-probs     yes     re-init
    gguf    --gguf FILE       GGUFSubject    a regular file with GGUF's magic   weights, margins, lp   no      none
    routes  --routes FILE     RoutesSubject  an engine's record (by content)    experts only           no      none

A kind declares its flag and settings, how it is recognised, what it gives, and how it loads into a `Subject` whose
`routing` satisfies moe_lm/routing/routed_model.py's `RoutedModel`; its optional hooks (a shape for `--served`, its
weights for `--attribute`, work kept for `analyze`) each have a default that says "not this kind". Adding a kind is
one file here (its request, its kind, `register_subject_kind`) imported below: `moe-lm analyze` then takes its flag,
`--compare` recognises it, and the recorder records it (docs/analytics.md, "Adding a kind of subject").
"""

from moe_lm.analysis.subjects import gguf, hf, routes, run  # noqa: F401 - registers the kinds
from moe_lm.analysis.subjects.base import (  # noqa: F401 - the room's interface
    DEFAULT_WINDOW_LENGTH,
    KINDS,
    SEQ_LEN,
    Flag,
    NotInArchitecture,
    PruneSource,
    Settings,
    SubjectKind,
    SubjectRequest,
    described,
    kind_of,
    load_subject,
    recognise,
    recognised,
    register_subject_kind,
    served_shape,
    what_they_are,
    window_length_of,
)
from moe_lm.analysis.subjects.gguf import GGUFSubject  # noqa: F401
from moe_lm.analysis.subjects.hf import HFSubject  # noqa: F401
from moe_lm.analysis.subjects.loaded import OwnDocuments, Shape, Subject, TrainingRun  # noqa: F401
from moe_lm.analysis.subjects.routes import RoutesSubject  # noqa: F401
from moe_lm.analysis.subjects.run import RunSubject  # noqa: F401
