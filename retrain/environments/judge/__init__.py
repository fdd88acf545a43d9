"""`[reward] type = "judge"`: the reward (reward), one request over the openai SDK (client), the
rubric and its reply (prompt).
May import environments' own modules, slots, config and the floors below."""
