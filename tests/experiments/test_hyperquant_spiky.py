from experiments import hyperquant_spiky


def test_table_row_per_spec_and_spikes_survive(capsys):
    assert hyperquant_spiky.main(["--spec", "hyperquant:d4,2bps"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| spec | one-hot | spike + noise |")
    [row] = [line for line in lines if line.startswith("| `hyperquant:d4,2bps`")]
    cells = row.split(" | ")
    one_hot, spike = cells[1], cells[2]
    # every one-hot block overflows its budget at 2 bps; the fallback keeps the spike
    assert "100% fb" in one_hot and "0% zero" in one_hot and "0% zero" in spike
    assert float(one_hot.split()[0]) < 0.01
