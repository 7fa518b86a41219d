from gpufrac.kubectl.command import main

main()
