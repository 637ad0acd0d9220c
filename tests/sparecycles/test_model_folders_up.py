"""`up --model DIR`: the default run folder is named by the model folder's and the data's names, apart from the demo's
(sparecycles.up_plan.plan_up; checks and names only, starts nothing). The end-to-end `up --model DIR --data DIR`
run is tests/trainer/test_model_folders.py's."""

from __future__ import annotations

from pathlib import Path

from support.user_data import hf_tokenizer_dir, real_documents, write_formats


def test_up_default_folder_carries_the_model_and_data_names(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    from sparecycles.up_plan import plan_up

    monkeypatch.setenv("SPARECYCLES_RUNS", str(tmp_path / "runs"))
    model: Path = hf_tokenizer_dir(tmp_path / "my llama", vocab_size=400)
    LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(model)
    data = write_formats(tmp_path / "in", real_documents()[:20])["txt"]
    plan = plan_up(settings={"model": str(model), "data": str(data)})
    assert plan.out == (tmp_path / "runs" / "up-demo-zocurv-line-my-llama-txt").resolve()
    assert plan.zo_cfg.run_dir == plan.out / "zocurv-line" and plan.base_cfg.model == str(model)
    assert plan_up().out.name == "up-demo-zocurv-line"  # the demo's own model and corpus: no tag
    assert plan_up(settings={"data": str(data) + "/"}).out.name == "up-demo-zocurv-line-txt"
