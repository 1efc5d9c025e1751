from mixgemm.specs import DecodeSpec, Activation
from mixgemm.types import ActType, WeightType
def specs():
    out = []
    for w in (WeightType.U4, WeightType.U2, WeightType.S8):
        for tok in (8, 16):
            for ks in (1, 2, 4, 8):
                for act in (Activation.NONE, Activation.SWIGLU):
                    out.append(DecodeSpec(ActType.BF16, w, tok, 8, max(1024, 128 * w.bits), 4, act, ks))
    return out
