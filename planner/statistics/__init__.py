"""The statistics of measuring: the race, its schedule of rounds, and the confirmation's verdict."""
