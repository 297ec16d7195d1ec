"""EpisodeBatch: the column batch of one iteration (agentgym/batch.py)."""

from __future__ import annotations

import pytest
import torch

from agentgym.batch import EpisodeBatch
from agentgym.types import Episode


def _episode(i: int, n: int, starts=()) -> Episode:
    return Episode(f"e{i}", f"g{i // 2}", "keyword", 0, 0, 4, input_ids=list(range(n)),
                   loss_mask=[0, 0] + [1] * (n - 2), old_logprobs=[0.0, 0.0] + [-0.5] * (n - 2),
                   context_starts=list(starts))


def test_from_episodes_keeps_order_and_token_columns():
    eps = [_episode(0, 5), _episode(1, 3), _episode(2, 4)]
    b = EpisodeBatch.from_episodes(eps)
    assert len(b) == 3 and b["episode_id"] == ["e0", "e1", "e2"] and b["group_id"] == ["g0", "g0", "g1"]
    assert b["input_ids"][1] == [0, 1, 2] and "advantages" not in b


def test_a_padded_tensor_column_is_cut_to_each_row_width():
    b = EpisodeBatch.from_episodes([_episode(0, 5), _episode(1, 3)])
    adv = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    b2 = b.with_columns(advantages=adv)
    assert b2["advantages"] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert "advantages" not in b  # the original is unchanged


def test_padding_gives_the_trainer_batch_with_zero_advantages_before_the_advantage_step():
    t = EpisodeBatch.from_episodes([_episode(0, 5), _episode(1, 3)]).padded(pad_id=99)
    assert t.input_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 99, 99]]
    assert t.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert t.advantages.abs().sum() == 0 and t.returns is None


def test_the_row_mask_keeps_rows_in_order():
    b = EpisodeBatch.from_episodes([_episode(i, 3 + i) for i in range(4)]).with_columns(
        advantages=[[float(i)] * (3 + i) for i in range(4)])
    kept = b.select([True, False, True, False])
    assert kept["episode_id"] == ["e0", "e2"] and kept["advantages"][1] == [2.0] * 5
    with pytest.raises(ValueError, match="3 flags for 4 rows"):
        b.select([True] * 3)


def test_segments_cut_rows_at_context_starts_and_say_where_each_came_from():
    b = EpisodeBatch.from_episodes([_episode(0, 8, starts=[4]), _episode(1, 3)])
    segs, spans = b.segments()
    assert spans == [(0, 0, 4), (0, 4, 8), (1, 0, 3)]
    assert segs["input_ids"] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2]] and "context_starts" not in segs
    plain, same = EpisodeBatch.from_episodes([_episode(0, 4)]).segments()
    assert same == [(0, 0, 4)] and plain["input_ids"] == [[0, 1, 2, 3]]


@pytest.mark.parametrize("bad,match", [
    ({"episode_id": ["a"], "input_ids": [[1, 2]], "loss_mask": [[0, 1]]}, r"missing columns \['old_logprobs'\]"),
    ({"episode_id": ["a"], "input_ids": [[1, 2]], "loss_mask": [[0, 1]], "old_logprobs": [[0.0, 0.0]],
      "rewardz": [1]}, r"unknown columns \['rewardz'\]"),
    ({"episode_id": ["a", "b"], "input_ids": [[1, 2]], "loss_mask": [[0, 1]], "old_logprobs": [[0.0, 0.0]]},
     "column 'input_ids' has 1 rows, episode_id has 2"),
    ({"episode_id": ["a"], "input_ids": [[1, 2]], "loss_mask": [[0, 1]], "old_logprobs": [[0.0, 0.0]],
      "returns": [[1.0]]}, r"row 0 \(a\): returns has 1 values for 2 tokens"),
])
def test_a_malformed_batch_names_the_column_and_row(bad, match):
    with pytest.raises(ValueError, match=match):
        EpisodeBatch(bad)
