"""Lower bounds: on each device's memory (`memory`, with `crossing`) and on every plan's makespan (`time`)."""
