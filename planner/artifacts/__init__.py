"""The artifacts that cross the boundaries: Profile and Plan (and their JSON), the study TOML, the memory budget."""
