"""Planning: what this machine has (memory.py), the memory model and planner (planner.py), device profiles
(profiles.py), the resolution of every setting into one RunSpec (resolve.py) and loading an engine from it
(load.py). Above the engine, below the session and the user interfaces."""
