"""The simulated side of the bottom floor: the corpus of real code, the editor that types it, the simulated
users, and the held-out acceptance they measure. It imports only the core."""
