"""The research variants the experiments compare with the DeepSeek-V3 core: attention masks (prefix LM, masked-LM
encoders), objectives (prefix LM, masked LM) and an encoder-decoder architecture.

They plug into the core through its extension points (moe_lm/model/masks.py, moe_lm/train/objective.py,
moe_lm/model/architectures.py) when this package is imported; the core never imports it. The moe-lm command and
the launch/ scripts import it, so that every config name below works there.
"""

from moe_lm.experiments.variants import encdec, masks, objectives

masks.register()
objectives.register()
encdec.register()
