"""`make run CHECKPOINT=/dir` path: a server rendered for a checkpoint directory (original layout,
sharded, with a language-model shard) serves that checkpoint's embeddings."""

import numpy as np
import torch

from backends.config import EncoderConfig
from backends.deploy.repository import Deployment
from backends.deploy.launcher import deployment_server
from backends.preprocess import Preprocessor
from backends.checkpoint.weights import load_vision_model
from oracles.random_checkpoint import write_checkpoint
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like, text_card

TINY = EncoderConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=48, text_hidden_size=40)


def test_server_serves_a_checkpoint_directory(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", TINY, dtype=torch.bfloat16)
    dep = Deployment(device="cpu", checkpoint=str(ckpt))
    assert dep.vision.encoder.text_hidden_size == 40  # the rendered configs follow the checkpoint
    blobs = [encode(photo_like(300, 200, seed=4), "JPEG"), encode(text_card(), "PNG")]
    with deployment_server(dep, "checkpoint-test") as server:
        client = KimiVisionClient(server.grpc_url)
        r = client.infer(chat_prompt_ids(2), blobs)
        client.close()
    model, cfg = load_vision_model(ckpt)  # bf16 on disk, fp32 on CPU
    pv, grids, _ = Preprocessor(cfg.media)(blobs)
    expected = model(pv, grids).numpy()
    assert r.image_embeds.shape == expected.shape == (sum(r.token_counts.tolist()), 40)
    np.testing.assert_allclose(r.image_embeds, expected, rtol=1e-5, atol=1e-6)
