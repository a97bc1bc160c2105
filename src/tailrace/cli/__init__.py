"""Command line: tailrace run | plan | demo."""
