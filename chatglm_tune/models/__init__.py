"""The model families: one folder each (`chatglm6b`, `glm`), the interface they implement (`version`),
and the one table of versions (`registry`)."""
