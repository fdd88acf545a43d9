"""TOML texts that several tests hand to `explain`, `status` and the campaign matrix."""

# One run of the default model on the CPU: what `explain` plans for without a campaign.
SINGLE_RUN = """
[training]
batch_size = 2
group_size = 8
max_tokens = 1024
max_steps = 20
[model]
device = "cpu"
"""

# Two conditions of a campaign (append lines to add to the second).
GRPO_VS_RLOO = """[[campaign.conditions]]
name = "grpo"
"algorithm.advantage" = "grpo"
[[campaign.conditions]]
name = "rloo"
"algorithm.advantage" = "rloo"
"""
