"""What-if: CORM's cap ranks by how recently a key was last found important (then the latest attention)."""
import sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).parent))
from localchat.engine.policies.corm import CORM
import diagnose


def score(self, layer, layer_idx):
    m = self.aligned(layer_idx, layer)
    w = m.rows.shape[1]
    order = torch.arange(1, w + 1, device=m.rows.device, dtype=torch.float32)[None, :, None]
    last = (m.rows.float() * order).amax(dim=1)  # [H_kv, n]: 1-based index of the latest row marking it, 0: none
    return last + layer.scores


CORM.score = score
diagnose.main()
