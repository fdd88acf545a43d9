"""What a user types (floor 5): the Typer app (`app`), launch, explain and its warnings, status and
its view, plot, templates, the config reference (`docgen`) and rendering. Thin: parse, call one
function of a lower floor, render."""
