from trainrun.cli import command

command()
