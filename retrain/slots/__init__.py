"""The API budget (floor 2): at most `max_concurrent` calls in flight across a campaign.
`file_slots`: the file semaphore on one machine (and the no-op); `ray_slots`: the same across
nodes, a named Ray actor; `semaphore`: what the two share.
Imports no backend and no campaign code."""
