"""The [sft] stage's data: its conversations (data) and one conversation's datum (datums).
May import environments' own modules, backends.base, config and the floors below."""
