"""What every part leans on: user errors, atomic writes, folder locks, Hub reachability, quiet libraries, wording, configs, CLI parsing."""
