"""The Ray worker group: one actor per simulated CS-2 system, the driver that runs them, the
hardware each gets, and progress from rank 0 to the driver."""
