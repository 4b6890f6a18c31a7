"""The torch release lines this project is tested on, and what an error about a missing torch API advises."""

TESTED_TORCH: tuple[str, ...] = ("2.13", "2.14", "2.15")
# What an error about a missing torch API advises: the tested lines, and the newest to install.
TESTED_ADVICE = f"tested with torch {', '.join(TESTED_TORCH)}; install torch=={TESTED_TORCH[-1]}.*"
