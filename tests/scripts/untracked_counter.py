"""Training whose learning rate follows a counter the script keeps and does not track: after a
failover the replacement restarts it, and its parameters leave its peers one update later."""
import sys, torch, hotspare
job = hotspare.init()
torch.manual_seed(0)
model = job.ddp(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.track(model=model, optimizer=opt)
updates = 0                    # untracked state the update depends on
for step in job.steps(int(sys.argv[1])):
    with step:
        for group in opt.param_groups:
            group["lr"] = 0.1 * 0.9 ** updates
        g = hotspare.seed_step(0, job.rank, step)
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        updates += 1
