"""The composition: the agent, its executor, verbs, recorder, reservations, hot-plug."""
