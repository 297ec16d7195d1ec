"""The MLflow pyfunc of a trained policy (a "model from code" file: MLflow copies this file into
the logged model and runs it on ``mlflow.pyfunc.load_model``, so loading needs mlflow, torch and
transformers, not this project).

``predict`` takes a DataFrame with a ``prompt`` column (the user message: an environment's
observation) and an optional ``system`` column, renders each with the policy's chat template and
returns the greedy replies; the ``max_new_tokens`` param (default 64) caps a reply. It is the
single-turn view of the policy: the training rollouts feed it whole multi-turn conversations
token by token (``agentgym.rollout.loop``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import mlflow
from mlflow.pyfunc import PythonModel

if TYPE_CHECKING:
    from transformers import BatchEncoding


class PolicyPyfunc(PythonModel):
    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts["policy"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path)
        self.model.eval()

    def predict(self, context, model_input, params=None):
        import torch

        max_new = int((params or {}).get("max_new_tokens", 64))
        rows = model_input.to_dict("records") if hasattr(model_input, "to_dict") else \
            [{"prompt": p} for p in model_input]
        replies = []
        for row in rows:
            messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + \
                [{"role": "user", "content": str(row["prompt"])}]
            # return_dict=True: a BatchEncoding (transformers types every return mode together)
            enc = cast("BatchEncoding", self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True))
            ids = enc["input_ids"]
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                          do_sample=False, pad_token_id=self.tokenizer.pad_token_id
                                          or self.tokenizer.eos_token_id)
            replies.append(self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        return replies


mlflow.models.set_model(PolicyPyfunc())
