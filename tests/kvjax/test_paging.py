"""The host's page pool: hand-out order, reference counts, copy-on-write, bad input."""

import numpy as np
import pytest

from kvjax.paging import OutOfPagesError, PagePool, table


def test_pages_are_handed_out_lowest_first_and_come_back_when_free():
    pool = PagePool(6)
    assert pool.allocate(3) == [0, 1, 2] and pool.free == 3 and pool.used == 3
    assert pool.allocate(1) == [3]
    pool.release([1, 0])
    assert pool.free == 4
    assert pool.allocate(3) == [0, 1, 4]  # freed pages first, lowest first
    assert pool.refs.tolist() == [1, 1, 1, 1, 1, 0]


def test_a_shared_page_is_free_only_when_its_last_holder_leaves():
    pool = PagePool(4)
    prefix = pool.allocate(2)
    pool.share(prefix)  # a second row holds the prompt's pages
    assert pool.refs[prefix].tolist() == [2, 2]
    pool.release(prefix)
    assert pool.free == 2 and pool.refs[prefix].tolist() == [1, 1]
    pool.release(prefix)
    assert pool.free == 4


def test_writing_a_shared_page_copies_it_first():
    pool = PagePool(4)
    (page,) = pool.allocate(1)
    assert pool.writable(page) == (page, None)  # one holder writes in place
    pool.share([page])
    fresh, source = pool.writable(page)
    assert (fresh, source) == (1, page)
    assert pool.refs[[page, fresh]].tolist() == [1, 1]
    assert pool.writable(page) == (page, None)  # the other row now holds it alone


def test_an_empty_pool_raises_and_takes_nothing():
    pool = PagePool(3)
    pool.allocate(2)
    with pytest.raises(OutOfPagesError, match="1 free pages of 3, 2 needed") as caught:
        pool.allocate(2)
    assert (caught.value.needed, caught.value.free, caught.value.total) == (2, 1, 3)
    assert isinstance(caught.value, MemoryError) and pool.free == 1
    pool.share([0])
    pool.allocate(1)
    with pytest.raises(OutOfPagesError):
        pool.writable(0)  # a copy needs a page too


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_pool_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="num_pages must be a positive int"):
        PagePool(bad)


def test_pages_outside_the_pool_or_not_held_are_refused():
    pool = PagePool(3)
    pool.allocate(1)
    with pytest.raises(ValueError, match=r"pages \[3\] are outside the pool 0..2"):
        pool.share([3])
    with pytest.raises(ValueError, match=r"pages \[1\] are not held by any row"):
        pool.release([1])
    with pytest.raises(ValueError, match=r"released more often"):
        pool.release([0, 0])
    assert pool.refs.tolist() == [1, 0, 0]  # the failed release changed nothing
    with pytest.raises(ValueError, match="count must be a non-negative int"):
        pool.allocate(-1)


def test_tables_list_each_rows_pages_and_mark_the_rest_empty():
    np.testing.assert_array_equal(table([[4, 2], [], [0, 1, 3]], 3),
                                  [[4, 2, -1], [-1, -1, -1], [0, 1, 3]])
    with pytest.raises(ValueError, match="row 0 holds 3 pages, its table has room for 2"):
        table([[0, 1, 2]], 2)
