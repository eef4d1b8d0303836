"""Print our encoder's max relative error against transformers' Kimi_K25 (fp32, CPU) on images and video chunks.

    python -m bench.encoder_oracle
"""
import torch
from tests.hf_oracle import hf_config, hf_model, load_ours, hf_image_features, rel_err
grids = [(1, 4, 6), (1, 8, 8), (1, 10, 4), (2, 6, 8), (3, 4, 4), (4, 8, 10)]
m = hf_model(hf_config(hidden=64, layers=2, heads=4, intermediate=128, pos_emb=8, text_hidden=96))
ours = load_ours(m)
n = sum(t * h * w for t, h, w in grids)
px = torch.rand(n, 3, 14, 14, generator=torch.Generator().manual_seed(3)) * 2 - 1
ref = hf_image_features(m, px, torch.tensor(grids))
print(f"grids {grids}\nmax|ours - transformers| / max|transformers| = {rel_err(ours(px, grids), ref):.3e}")
